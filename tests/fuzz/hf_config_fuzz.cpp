// libFuzzer target for the Hugging Face config reader (see harness.h; built by
// tests/fuzz/CMakeLists.txt when a clang with -fsanitize=fuzzer is found).
// Run: fuzz_hf_config -max_total_time=60 NEW_DIR tests/fuzz/corpus/hf_config
#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return loom::fuzz::hf_config(data, size); }
