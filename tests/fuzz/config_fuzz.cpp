// libFuzzer target for the config reader (see harness.h; built by tests/fuzz/CMakeLists.txt when a
// clang with -fsanitize=fuzzer is found). Run: fuzz_config -max_total_time=60 NEW_DIR tests/fuzz/corpus/config
#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return loom::fuzz::config(data, size); }
