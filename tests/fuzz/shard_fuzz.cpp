// libFuzzer target for the shard reader (see harness.h; built by tests/fuzz/CMakeLists.txt when a
// clang with -fsanitize=fuzzer is found). Run: fuzz_shard -max_total_time=60 NEW_DIR tests/fuzz/corpus/shard
#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return loom::fuzz::shard(data, size); }
