// Encodes a file with an npm GPT-2 tokenizer and writes the ids as one line of space-separated
// numbers (the format of `loom tokenizer encode`); reports MB/s on stderr.
//
// usage: node tokenizer_peer.js NPM_DIR LIBRARY INPUT OUTPUT
//   NPM_DIR  folder whose node_modules holds the peer (see tokenizer_vs_npm.sh)
//   LIBRARY  gpt-tokenizer | js-tiktoken
'use strict';
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');

const [npmDir, library, input, output] = process.argv.slice(2);
if (!output) {
  console.error('usage: node tokenizer_peer.js NPM_DIR gpt-tokenizer|js-tiktoken INPUT OUTPUT');
  process.exit(2);
}
const req = createRequire(path.join(path.resolve(npmDir), 'package.json'));

function version(pkg) {
  const file = path.join(path.resolve(npmDir), 'node_modules', pkg, 'package.json');
  return JSON.parse(fs.readFileSync(file, 'utf8')).version;
}

function loadEncoder(name) {
  if (name === 'gpt-tokenizer') {
    const enc = req('gpt-tokenizer/encoding/r50k_base');
    return { version: version('gpt-tokenizer'), encode: (s) => enc.encode(s) };
  }
  if (name === 'js-tiktoken') {
    const { Tiktoken } = req('js-tiktoken/lite');
    const ranks = req('js-tiktoken/ranks/gpt2');
    const enc = new Tiktoken(ranks.default || ranks);
    // The text is ordinary text: special-token spellings in it are encoded as text.
    return { version: version('js-tiktoken'), encode: (s) => enc.encode(s, [], []) };
  }
  throw new Error(`unknown library ${name}`);
}

const t0 = process.hrtime.bigint();
const enc = loadEncoder(library);
const text = fs.readFileSync(input, 'utf8');
const bytes = Buffer.byteLength(text, 'utf8');
enc.encode(text.slice(0, 100000));  // warm up the JIT on a slice
const t1 = process.hrtime.bigint();
const ids = enc.encode(text);
const t2 = process.hrtime.bigint();
fs.writeFileSync(output, ids.join(' ') + '\n');
const s = Number(t2 - t1) / 1e9;
console.error(`${library} ${enc.version}: ${bytes} bytes -> ${ids.length} tokens in ` +
              `${s.toFixed(3)} s: ${(bytes / 1e6 / s).toFixed(2)} MB/s (node ${process.version}; ` +
              `loaded in ${(Number(t1 - t0) / 1e9).toFixed(3)} s)`);
