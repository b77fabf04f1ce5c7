// Fuzz harnesses for loom's file readers. Each takes arbitrary bytes, hands them to the reader as
// a file, and returns 0; a loom::Error is the expected answer to bad input, anything else (a
// crash, a sanitizer report, another exception, a broken invariant of an accepted file) aborts.
// The libFuzzer targets (<name>_fuzz.cpp) and the GoogleTest that mutates the seed corpus
// (fuzz_test.cpp) call the same functions.
#pragma once
#include <cstddef>
#include <cstdint>

namespace loom::fuzz {

// Safetensors (train/safetensors.h): the header is parsed and validated; an accepted file must
// tile its data buffer exactly and every tensor must read back.
int safetensors(const uint8_t* data, size_t size);

// Token shards (data/shard.h). The first byte chooses whether the header and payload CRC-32 fields
// are recomputed before the rest is written, so inputs get past the checksums to the fields
// behind them.
int shard(const uint8_t* data, size_t size);

// Vocabularies (data/tokenizer.h, encoder.json + vocab.bpe): the input is split at its first NUL
// byte into the two files. An accepted vocabulary must decode what it encodes.
int vocab(const uint8_t* data, size_t size);

// Checkpoint manifests (train/checkpoint.h): the input is written as the manifest.json of a
// checkpoint directory named for step 3. The first byte chooses whether a matching
// manifest.crc32 is written beside it (to get past the manifest's checksum to its fields). An
// accepted manifest has non-negative counters, step 3, and 32-bit checksums.
int manifest(const uint8_t* data, size_t size);

// Training configs (train/config.h): the input is the TOML file. An accepted config must write
// back (config_to_toml) to a file that loads to the same TOML.
int config(const uint8_t* data, size_t size);

// Hugging Face GPT-2 config.json (train/hf_config.h). An accepted config must write back
// (hf_config_json) to JSON that reads as the same model.
int hf_config(const uint8_t* data, size_t size);
// A Hugging Face tokenizer.json: read, then every text it encodes decodes back, and a saved copy
// reads back to the same fingerprint.
int tokenizer_json(const uint8_t* data, size_t size);

}  // namespace loom::fuzz
