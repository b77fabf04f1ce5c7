# Shared by bench/tokenizer_vs_npm.sh and bench/llama3_tokenizer_vs_npm.sh (sourced, not run).

# npm_peers NPM_DIR PACKAGE@VERSION...: installs the packages into NPM_DIR/node_modules unless every
# one of them is there already.
npm_peers() {
  local dir=$1 p missing=0
  shift
  for p in "$@"; do [[ -d "$dir/node_modules/${p%@*}" ]] || missing=1; done
  (( missing )) || return 0
  echo "installing npm peers into $dir ..."
  mkdir -p "$dir"
  [[ -f "$dir/package.json" ]] || echo '{"private": true}' > "$dir/package.json"
  npm install --prefix "$dir" --no-audit --no-fund --silent "$@"
}

# english_corpus FILE: the King James Bible (Debian's bible-kjv) and the system's licence texts
# into FILE, unless FILE is there already.
english_corpus() {
  local file=$1
  [[ -s "$file" ]] && return 0
  : > "$file"
  if command -v bible > /dev/null; then bible gen1:1-rev22:21 >> "$file"; fi
  if [[ -d /usr/share/common-licenses ]]; then
    find /usr/share/common-licenses -maxdepth 1 -type f | LC_ALL=C sort | xargs cat >> "$file"
  fi
}
