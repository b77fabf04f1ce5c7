// libFuzzer target for the vocab reader (see harness.h; built by tests/fuzz/CMakeLists.txt when a
// clang with -fsanitize=fuzzer is found). Run: fuzz_vocab -max_total_time=60 NEW_DIR tests/fuzz/corpus/vocab
#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return loom::fuzz::vocab(data, size); }
