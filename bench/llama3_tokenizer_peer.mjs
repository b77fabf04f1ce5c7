// Llama 3's tokenizer in npm packages, for bench/llama3_tokenizer_vs_npm.sh:
//
//   node llama3_tokenizer_peer.mjs NPM_DIR export OUT_DIR
//     writes OUT_DIR/tokenizer.json, Hugging Face's format, from the vocabulary and merges that
//     llama3-tokenizer-js ships (the 128,000 tokens, the merges in rank order, the 256 special
//     tokens, Llama 3's pre-tokenisation regex and ignore_merges, as Meta's tokenizer.json has
//     them), so that loom and @huggingface/tokenizers read the same tokenizer;
//   node llama3_tokenizer_peer.mjs NPM_DIR export-digits IN_DIR OUT_DIR
//     the same vocabulary and merges under SmolLM's pre-tokenisation (Digits with
//     individual_digits, then ByteLevel with GPT-2's regex; merges not ignored), a second
//     pre-tokeniser to hold loom and @huggingface/tokenizers to;
//   node llama3_tokenizer_peer.mjs NPM_DIR encode LIBRARY TOKENIZER_JSON INPUT OUTPUT
//     encodes INPUT with LIBRARY (llama3-tokenizer-js | @huggingface/tokenizers, the latter from
//     TOKENIZER_JSON), no begin/end-of-text tokens added (special-token spellings in the text are
//     matched, as both libraries do: loom's --allow-special), and writes the ids as one line of
//     numbers (the format of `loom tokenizer encode`); MB/s on stderr.
import fs from 'fs';
import path from 'path';
import { createRequire } from 'module';
import { pathToFileURL } from 'url';

const [npmDir, mode, ...rest] = process.argv.slice(2);
const req = createRequire(path.join(path.resolve(npmDir), 'package.json'));
const version = (pkg) =>
  JSON.parse(fs.readFileSync(path.join(path.resolve(npmDir), 'node_modules', pkg, 'package.json'), 'utf8')).version;
const load = async (pkg) => import(pathToFileURL(req.resolve(pkg)).href);

const LLAMA3_PATTERN =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

if (mode === 'export') {
  const t = (await load('llama3-tokenizer-js')).default;
  const nBase = 128000;
  const vocab = {};
  for (let id = 0; id < nBase; ++id) vocab[t.vocabById[id]] = id;
  const merges = [...t.merges.entries()].sort((a, b) => a[1] - b[1]).map(([k]) => k);
  const added = [];
  for (let id = nBase; id < t.vocabById.length; ++id)
    added.push({ id, content: t.vocabById[id], single_word: false, lstrip: false, rstrip: false,
                 normalized: false, special: true });
  const json = {
    version: '1.0', truncation: null, padding: null, added_tokens: added, normalizer: null,
    pre_tokenizer: { type: 'Sequence', pretokenizers: [
      { type: 'Split', pattern: { Regex: LLAMA3_PATTERN }, behavior: 'Isolated', invert: false },
      { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false } ] },
    post_processor: null,
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
             fuse_unk: false, byte_fallback: false, ignore_merges: true, vocab, merges },
  };
  fs.mkdirSync(rest[0], { recursive: true });
  fs.writeFileSync(path.join(rest[0], 'tokenizer.json'), JSON.stringify(json));
  console.error(`llama3-tokenizer-js ${version('llama3-tokenizer-js')}: ${nBase} tokens, ${merges.length} merges, ` +
                `${added.length} special tokens -> ${path.join(rest[0], 'tokenizer.json')}`);
  process.exit(0);
}

if (mode === 'export-digits') {
  const json = JSON.parse(fs.readFileSync(path.join(rest[0], 'tokenizer.json'), 'utf8'));
  json.pre_tokenizer = { type: 'Sequence', pretokenizers: [
    { type: 'Digits', individual_digits: true },
    { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true } ] };
  json.model.ignore_merges = false;
  fs.mkdirSync(rest[1], { recursive: true });
  fs.writeFileSync(path.join(rest[1], 'tokenizer.json'), JSON.stringify(json));
  process.exit(0);
}

if (mode !== 'encode' || rest.length !== 4) {
  console.error('usage: node llama3_tokenizer_peer.mjs NPM_DIR export OUT_DIR | encode LIBRARY TOKENIZER_JSON INPUT OUTPUT');
  process.exit(2);
}
const [library, tokenizerJson, input, output] = rest;
const t0 = process.hrtime.bigint();
let encode;
if (library === 'llama3-tokenizer-js') {
  const t = (await load('llama3-tokenizer-js')).default;
  encode = (s) => t.encode(s, { bos: false, eos: false });
} else if (library === '@huggingface/tokenizers') {
  const mod = await load('@huggingface/tokenizers');
  const Tokenizer = mod.Tokenizer ?? mod.default.Tokenizer;
  const tok = new Tokenizer(JSON.parse(fs.readFileSync(tokenizerJson, 'utf8')), {});
  encode = (s) => tok.encode(s, { add_special_tokens: false }).ids;
} else {
  throw new Error(`unknown library ${library}`);
}
const text = fs.readFileSync(input, 'utf8');
const bytes = Buffer.byteLength(text, 'utf8');
encode(text.slice(0, 100000));  // warm up the JIT on a slice
const t1 = process.hrtime.bigint();
const ids = encode(text);
const t2 = process.hrtime.bigint();
fs.writeFileSync(output, Array.from(ids).join(' ') + '\n');
const s = Number(t2 - t1) / 1e9;
console.error(`${library} ${version(library)}: ${bytes} bytes -> ${ids.length} tokens in ${s.toFixed(3)} s: ` +
              `${(bytes / 1e6 / s).toFixed(2)} MB/s (node ${process.version}; loaded in ` +
              `${(Number(t1 - t0) / 1e9).toFixed(3)} s)`);
