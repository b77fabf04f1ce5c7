#include "train/safetensors.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"

using namespace loom;
using loom::train::SafetensorsReader;
using loom::train::SafetensorsWriter;

namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("loom_st_" + std::to_string(::getpid()) + "_" + name)).string();
}

// A file with an explicit header length, header text and `data_bytes` zero bytes of data.
std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                      int64_t length_override = -1) {
  std::string path = temp_path(name);
  std::ofstream f(path, std::ios::binary);
  uint64_t n = length_override >= 0 ? uint64_t(length_override) : header.size();
  for (int i = 0; i < 8; ++i) f.put(char((n >> (8 * i)) & 0xff));
  f << header;
  f << std::string(data_bytes, '\0');
  return path;
}

// Expects the reader to throw a loom::Error whose message contains the path and every fragment.
void expect_bad(const std::string& path, std::initializer_list<std::string> fragments) {
  try {
    SafetensorsReader r(path);
    ADD_FAILURE() << "no error for " << path;
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
  }
  std::filesystem::remove(path);
}

}  // namespace

TEST(Safetensors, RoundTrip) {
  MemoryPool pool("st");
  Tensor a = Tensor::empty({2, 3}, DType::f32, MemTag::params, pool);
  for (int i = 0; i < 6; ++i) a.f32()[i] = float(i) * 0.5f - 1.0f;
  std::vector<int32_t> ids{7, -1, 42};
  std::vector<uint16_t> half{0x3c00, 0xc000};  // f16 1.0, -2.0
  std::vector<uint16_t> brain{0x3f80, 0x4040};  // bf16 1.0, 3.0
  SafetensorsWriter w;
  w.add("a", a);
  w.add("ids", DType::i32, {3}, ids.data());
  w.add("empty", DType::f32, {0, 4}, nullptr);
  w.add("half", DType::f16, {2}, half.data());
  w.add("brain", DType::bf16, {2}, brain.data());
  w.set_metadata("format", "test");
  std::string path = temp_path("roundtrip.safetensors");
  w.write(path);

  SafetensorsReader r(path);
  EXPECT_EQ(r.meta("format"), "test");
  EXPECT_THROW(r.meta("nope"), Error);
  ASSERT_EQ(r.entries().size(), 5u);
  EXPECT_EQ(r.entry("a").shape, (Shape{2, 3}));
  EXPECT_EQ(r.entry("a").dtype, DType::f32);
  Tensor b = r.load("a", MemTag::workspace, pool);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(b.f32()[i], a.f32()[i]);
  Tensor c = r.load("ids", MemTag::workspace, pool);
  EXPECT_EQ(c.i32()[0], 7);
  EXPECT_EQ(c.i32()[1], -1);
  EXPECT_EQ(r.entry("empty").nbytes(), 0u);
  EXPECT_EQ(r.read_f32("half"), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(r.read_f32("brain"), (std::vector<float>{1.0f, 3.0f}));
  EXPECT_THROW(r.read_f32("ids"), Error);
  // Wrong dtype, shape or size on read are errors naming the tensor.
  std::vector<float> dst(6);
  EXPECT_THROW(r.read_into("a", dst.data(), 24, DType::i32), Error);
  EXPECT_THROW(r.read_into("a", dst.data(), 24, DType::f32, {3, 2}), Error);
  EXPECT_THROW(r.read_into("a", dst.data(), 20, DType::f32), Error);
  try {
    r.entry("missing");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
  }
  std::filesystem::remove(path);
}

TEST(Safetensors, HeaderIsEightByteAligned) {
  SafetensorsWriter w;
  float x = 1.0f;
  w.add("x", DType::f32, {1}, &x);
  std::string path = temp_path("aligned.safetensors");
  w.write(path);
  std::ifstream f(path, std::ios::binary);
  unsigned char len[8];
  f.read(reinterpret_cast<char*>(len), 8);
  EXPECT_EQ(len[0] % 8, 0);
  EXPECT_EQ(std::filesystem::file_size(path), 8u + len[0] + 4u);
  std::filesystem::remove(path);
}

TEST(Safetensors, WriterRejectsDuplicatesAndBadNames) {
  SafetensorsWriter w;
  float x = 0;
  w.add("x", DType::f32, {1}, &x);
  EXPECT_THROW(w.add("x", DType::f32, {1}, &x), Error);
  EXPECT_THROW(w.add("__metadata__", DType::f32, {1}, &x), Error);
  EXPECT_THROW(w.add("", DType::f32, {1}, &x), Error);
  EXPECT_THROW(w.add("y", DType::f32, {2}, nullptr), Error);
}

TEST(Safetensors, MalformedHeaders) {
  const std::string ok = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  {
    SafetensorsReader r(write_raw("ok", ok, 8));
    EXPECT_EQ(r.entry("t").numel(), 2);
    std::filesystem::remove(r.path());
  }
  {  // missing file
    std::string p = temp_path("does_not_exist");
    expect_bad(p, {"cannot open"});
  }
  {  // shorter than the length field
    std::string p = temp_path("short");
    std::ofstream(p) << "abc";
    expect_bad(p, {"too short"});
  }
  expect_bad(write_raw("huge", ok, 8, int64_t(train::kMaxSafetensorsHeader) + 1), {"exceeds the limit"});
  expect_bad(write_raw("past_eof", ok, 8, int64_t(ok.size()) + 100), {"past the end"});
  expect_bad(write_raw("tiny_len", ok, 8, 1), {"too small"});
  expect_bad(write_raw("not_json", "{\"t\": [1, 2", 0), {"not valid JSON"});
  expect_bad(write_raw("not_object", "[1, 2, 3]", 0), {"JSON object"});
  expect_bad(write_raw("entry_not_object", R"({"t": 3})", 0), {"'t'", "object"});
  expect_bad(write_raw("dtype", R"({"t":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8),
             {"'t'", "unknown or unsupported dtype 'F64'"});
  expect_bad(write_raw("no_dtype", R"({"t":{"shape":[1],"data_offsets":[0,4]}})", 4), {"'t'", "dtype"});
  expect_bad(write_raw("no_shape", R"({"t":{"dtype":"F32","data_offsets":[0,4]}})", 4), {"'t'", "shape"});
  expect_bad(write_raw("neg_shape", R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
             {"'t'", "negative"});
  expect_bad(write_raw("float_shape", R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4),
             {"'t'", "shape"});
  expect_bad(write_raw("offsets_len", R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4),
             {"'t'", "data_offsets"});
  expect_bad(write_raw("span", R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
             {"'t'", "needs 12 bytes", "span 8"});
  expect_bad(write_raw("reversed", R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
             {"'t'", "end before"});
  expect_bad(write_raw("out_of_range", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
             {"'t'", "past the 4-byte data buffer"});
  expect_bad(write_raw("overlap",
                       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                       12),
             {"'b'", "overlap", "'a'"});
  expect_bad(write_raw("gap",
                       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                       12),
             {"'b'", "gap"});
  expect_bad(write_raw("trailing", ok, 12), {"cover 8", "12 bytes"});
  expect_bad(write_raw("meta", R"({"__metadata__":{"k":1}})", 0), {"__metadata__", "'k'"});
  expect_bad(write_raw("extra_field", R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4),
             {"'t'", "unknown field 'x'"});
  expect_bad(write_raw("huge_shape",
                       R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4),
             {"'t'", "too large"});
}
