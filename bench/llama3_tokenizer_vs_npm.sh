#!/usr/bin/env bash
# Llama 3's tokenizer: `loom tokenizer encode` side by side with llama3-tokenizer-js (which ships
# Llama 3's 128K vocabulary and pattern) and @huggingface/tokenizers (which reads tokenizer.json
# files, here the one exported from llama3-tokenizer-js's data), on a multilingual test text and on
# a few MB of text: every id equal, and MB/s of each. Then the same vocabulary under SmolLM's
# pre-tokenisation (each digit alone, GPT-2's pattern between) against @huggingface/tokenizers.
#
# usage: bench/llama3_tokenizer_vs_npm.sh [BUILD_DIR]
# The npm packages are installed once into BUILD_DIR/npm-peer (or $LOOM_NPM_DIR), and Llama 3's
# tokenizer.json written to BUILD_DIR/npm-peer/llama3 (tests/data/tokenizer_long_test.cpp finds
# both there). The larger corpus is the King James Bible (Debian's bible-kjv) and the system's
# licence texts, then the multilingual text 200 times; $LOOM_TOKENIZER_CORPUS names another file.
# Exit status: 0 when every peer's ids equal loom's, 1 otherwise.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
build="$(cd "${1:-$root/build}" && pwd)"
loom="$build/loom"
npm_dir="${LOOM_NPM_DIR:-$build/npm-peer}"
work="$build/tokenizer-bench"
vocab="$npm_dir/llama3"
multi="$root/tests/data/multilingual.txt"
peers=(llama3-tokenizer-js @huggingface/tokenizers)

[[ -x "$loom" ]] || { echo "llama3_tokenizer_vs_npm: no loom executable in $build (ninja -C $build loom)" >&2; exit 2; }
command -v node > /dev/null || { echo "llama3_tokenizer_vs_npm: node is not installed" >&2; exit 2; }
mkdir -p "$work"
source "$here/npm_peer_util.sh"
npm_peers "$npm_dir" llama3-tokenizer-js@1.2.0 @huggingface/tokenizers@0.2.0
[[ -s "$vocab/tokenizer.json" ]] || node "$here/llama3_tokenizer_peer.mjs" "$npm_dir" export "$vocab"
digits="$npm_dir/llama3-digits"
[[ -s "$digits/tokenizer.json" ]] || node "$here/llama3_tokenizer_peer.mjs" "$npm_dir" export-digits "$vocab" "$digits"

corpus="${LOOM_TOKENIZER_CORPUS:-$work/llama3_corpus.txt}"
if [[ -z "${LOOM_TOKENIZER_CORPUS:-}" && ! -s "$corpus" ]]; then
  english_corpus "$corpus"
  for _ in $(seq 200); do cat "$multi" >> "$corpus"; done
fi

echo "$(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
# compare NAME TOKENIZER_DIR TEXT PEER...
compare() {
  local name=$1 vocab=$2 text=$3
  shift 3
  echo "$name: $(wc -c < "$text") bytes"
  "$loom" tokenizer encode --vocab "$vocab" --allow-special --stats --out "$work/$name.loom.ids" "$text"
  "$loom" tokenizer encode --vocab "$vocab" --allow-special --stats --threads 2 --out "$work/$name.loom2.ids" "$text"
  if ! cmp -s "$work/$name.loom.ids" "$work/$name.loom2.ids"; then
    echo "MISMATCH: loom with 2 threads differs from 1 thread on $name" >&2
    status=1
  fi
  for p in "$@"; do
    out="$work/$name.$(echo "$p" | tr -d '@' | tr '/' '_').ids"
    node "$here/llama3_tokenizer_peer.mjs" "$npm_dir" encode "$p" "$vocab/tokenizer.json" "$text" "$out"
    if cmp -s "$work/$name.loom.ids" "$out"; then
      echo "  $p: ids equal to loom's"
    else
      echo "MISMATCH: $p ids differ from loom's ($out vs $work/$name.loom.ids)" >&2
      status=1
    fi
  done
  "$loom" tokenizer decode --vocab "$vocab" --out "$work/$name.decoded" "$work/$name.loom.ids"
  if cmp -s "$text" "$work/$name.decoded"; then
    echo "  decode(encode(text)) == text"
  else
    echo "MISMATCH: decode(encode($name)) differs from the text" >&2
    status=1
  fi
}
for text in "$multi" "$corpus"; do
  compare "$(basename "$text" .txt)" "$vocab" "$text" "${peers[@]}"
done
echo "SmolLM's pre-tokenisation on Llama 3's vocabulary:"
for text in "$multi" "$corpus"; do
  compare "$(basename "$text" .txt).digits" "$digits" "$text" @huggingface/tokenizers
done
exit $status
