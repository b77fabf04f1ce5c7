// libFuzzer target for the Hugging Face tokenizer.json reader (see harness.h; built by
// tests/fuzz/CMakeLists.txt when a clang with -fsanitize=fuzzer is found).
// Run: fuzz_tokenizer_json -max_total_time=60 NEW_DIR tests/fuzz/corpus/tokenizer_json
#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return loom::fuzz::tokenizer_json(data, size); }
