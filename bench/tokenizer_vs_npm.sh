#!/usr/bin/env bash
# GPT-2 encoding speed of `loom tokenizer encode` side by side with npm peers (gpt-tokenizer and
# js-tiktoken, run with node) on the same few MB of text, and a check that all ids are equal.
#
# usage: bench/tokenizer_vs_npm.sh [BUILD_DIR] [VOCAB_DIR]
#   BUILD_DIR  a loom build folder holding the `loom` executable (default: build)
#   VOCAB_DIR  GPT-2's encoder.json + vocab.bpe (default: ../shared/data/gpt2 beside the checkout)
# The npm packages are installed once into BUILD_DIR/npm-peer (or $LOOM_NPM_DIR), where the long
# test tests/data/tokenizer_long_test.cpp also finds them. The corpus is the King James Bible
# (Debian package bible-kjv) plus the system's licence texts; $LOOM_TOKENIZER_CORPUS names
# another file instead. Exit status: 0 when every peer's ids equal loom's, 1 otherwise.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
build="$(cd "${1:-$root/build}" && pwd)"
vocab="${2:-$root/../shared/data/gpt2}"
loom="$build/loom"
npm_dir="${LOOM_NPM_DIR:-$build/npm-peer}"
work="$build/tokenizer-bench"
peers=(gpt-tokenizer js-tiktoken)

[[ -x "$loom" ]] || { echo "tokenizer_vs_npm: no loom executable in $build (ninja -C $build loom)" >&2; exit 2; }
[[ -f "$vocab/encoder.json" && -f "$vocab/vocab.bpe" ]] ||
  { echo "tokenizer_vs_npm: no encoder.json + vocab.bpe in $vocab" >&2; exit 2; }
command -v node > /dev/null || { echo "tokenizer_vs_npm: node is not installed" >&2; exit 2; }
mkdir -p "$work"

source "$here/npm_peer_util.sh"
npm_peers "$npm_dir" gpt-tokenizer@4 js-tiktoken@1

corpus="${LOOM_TOKENIZER_CORPUS:-$work/corpus.txt}"
[[ -n "${LOOM_TOKENIZER_CORPUS:-}" ]] || english_corpus "$corpus"
bytes=$(wc -c < "$corpus")
(( bytes >= 1000000 )) || { echo "tokenizer_vs_npm: corpus $corpus has only $bytes bytes (install bible-kjv)" >&2; exit 2; }

echo "corpus: $corpus ($bytes bytes); $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
"$loom" tokenizer encode --vocab "$vocab" --stats --out "$work/loom.ids" "$corpus"
"$loom" tokenizer encode --vocab "$vocab" --stats --threads 2 --out "$work/loom2.ids" "$corpus"
if ! cmp -s "$work/loom.ids" "$work/loom2.ids"; then
  echo "MISMATCH: loom with 2 threads differs from 1 thread" >&2
  status=1
fi
for p in "${peers[@]}"; do
  node "$here/tokenizer_peer.js" "$npm_dir" "$p" "$corpus" "$work/$p.ids"
  if cmp -s "$work/loom.ids" "$work/$p.ids"; then
    echo "  $p: ids equal to loom's"
  else
    echo "MISMATCH: $p ids differ from loom's ($work/$p.ids vs $work/loom.ids)" >&2
    status=1
  fi
done
# Round trip through decode.
"$loom" tokenizer decode --vocab "$vocab" --out "$work/decoded.txt" "$work/loom.ids"
if cmp -s "$corpus" "$work/decoded.txt"; then
  echo "  decode(encode(corpus)) == corpus"
else
  echo "MISMATCH: decode(encode(corpus)) differs from the corpus" >&2
  status=1
fi
exit $status
