#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "train/config.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::train;

namespace {
struct TmpFile {
  std::string path;
  explicit TmpFile(const std::string& text) {
    path = (fs::temp_directory_path() / fmt::format("loom_cfg_{}_{}.toml", ::getpid(), std::rand())).string();
    std::ofstream(path) << text;
  }
  ~TmpFile() { fs::remove(path); }
};

std::string error_of(const std::string& text, std::vector<std::string> overrides = {}) {
  TmpFile f(text);
  try {
    load_config(f.path, overrides);
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(overrides.empty() ? f.path : "command line"), std::string::npos) << msg;
    return msg;
  }
  ADD_FAILURE() << "no error for:\n" << text;
  return "";
}

// `text` is refused naming `field` (and saying `more`, when given).
void expect_refused(const std::string& text, const std::string& field, const std::string& more = "") {
  const std::string m = error_of(text);
  EXPECT_NE(m.find(": " + field + ": "), std::string::npos) << "expected the field " << field << " in: " << m;
  if (!more.empty()) {
    EXPECT_NE(m.find(more), std::string::npos) << m;
  }
}
}  // namespace

TEST(TrainConfig, ParsesFileThenOverrides) {
  TmpFile f("[model]\npreset = \"gpt2-124m\"\n[optim]\nlr = 1e-3\nwarmup_steps = 5\n[train]\nsteps = 7\n");
  TrainConfig c = load_config(f.path, collect_overrides({"--optim.lr", "2e-4", "--train.out_dir=runs/x"}));
  EXPECT_EQ(c.model_preset, "gpt2-124m");
  EXPECT_FLOAT_EQ(c.lr, 2e-4f);
  EXPECT_EQ(c.warmup_steps, 5);
  EXPECT_EQ(c.steps, 7);
  EXPECT_EQ(c.out_dir, "runs/x");
  EXPECT_EQ(c.model(50257).n_embd, 768);
}

TEST(TrainConfig, IntegerAcceptedForFloat) {
  TmpFile f("[optim]\nlr = 1\n");
  EXPECT_FLOAT_EQ(load_config(f.path, {}).lr, 1.0f);
}

// Values a TOML file or the command line can hold but a run cannot use: each refused naming the
// file and the field, before any of it sizes an array (a batch of 2^58 sequences overflowed the
// allocation's size; dp x grad_accum of 2^64 divided by zero; a block_size of 2^62 wrapped the
// position table to no rows).
TEST(TrainConfig, OutOfRangeValuesAndMisplacedTablesAreRefused) {
  std::string m = error_of("", {"train.batch_size=288230376151711744"});
  EXPECT_NE(m.find("--train.batch_size: 288230376151711744 is out of range"), std::string::npos) << m;
  m = error_of("[model]\nblock_size = 4611686018427387904\n");
  EXPECT_NE(m.find("model.block_size: 4611686018427387904 is out of range"), std::string::npos) << m;
  m = error_of("[parallel]\nstage_layers = [1, -4294967296]\n");
  EXPECT_NE(m.find("parallel.stage_layers entry 1: -4294967296 is out of range"), std::string::npos) << m;
  EXPECT_EQ(load_config("", {"train.steps=2147483648"}).steps, int64_t(1) << 31);  // the bound itself
  // A NUL in a table header (toml++ tripped an internal assertion on it; found by fuzz_config).
  m = error_of(std::string("[\0\0model]\npreset = \"gpt2-tiny\"\n", 31));
  EXPECT_NE(m.find(":1:2: control character 0x00 (not a TOML text file)"), std::string::npos) << m;
  // A non-ASCII character where TOML expects a key or whitespace (U+FE7F sent toml++ to an
  // "unreachable" branch; found by fuzz_config); inside strings and comments any character is fine.
  m = error_of("\xef\xb9\xbf\n");
  EXPECT_NE(m.find(":1:1: a non-ASCII character outside a string or comment"), std::string::npos) << m;
  {
    TmpFile ok("# caf\xc3\xa9 \xef\xb9\xbf\n[train]\nsample_prompt = \"\xef\xb9\xbf caf\xc3\xa9 \\\" '\"\n"
               "out_dir = '''runs/x'''\n[optim]\nschedule = \"\"\"cosine\"\"\"\n");
    const TrainConfig c = load_config(ok.path, {});
    EXPECT_EQ(c.sample_prompt, "\xef\xb9\xbf caf\xc3\xa9 \" '");
    EXPECT_EQ(c.out_dir, "runs/x");
  }
  // Threads beyond 8 per core (libgomp crashed starting 100000 of them).
  m = error_of("", {"train.threads=100000"});
  EXPECT_NE(m.find("train.threads: 100000 is more than 8 per core of this host"), std::string::npos) << m;
  // A table where a value belongs, and a section that holds no field.
  m = error_of("[optim]\nlr = {}\n");
  EXPECT_NE(m.find("optim.lr: expected float, got a table"), std::string::npos) << m;
  m = error_of("[modle]\n");
  EXPECT_NE(m.find("unknown section [modle]"), std::string::npos) << m;
  // Non-finite floats: an eps of inf made every update zero.
  m = error_of("[optim]\neps = inf\n");
  EXPECT_NE(m.find("optim.eps: must be a finite number, got inf"), std::string::npos) << m;
  m = error_of("", {"optim.lr=inf"});
  EXPECT_NE(m.find("optim.lr: must be a finite number"), std::string::npos) << m;
  // Pipeline stages the chain cannot fill, and interleaving without enough micro-batches.
  m = error_of("", {"model.n_layer=2", "parallel.pp=8", "train.batch_size=8"});
  EXPECT_NE(m.find("--parallel.pp: 8 pipeline stages but the model's chain has only 4 elements"), std::string::npos)
      << m;
  m = error_of("", {"parallel.pp=2", "parallel.schedule=interleaved", "train.grad_accum=1"});
  EXPECT_NE(m.find("train.grad_accum"), std::string::npos) << m;
  // A directory is not a config.
  const fs::path dir = fs::temp_directory_path() / fmt::format("loom_cfg_dir_{}.toml", ::getpid());
  fs::create_directories(dir);
  try {
    load_config(dir.string(), {});
    ADD_FAILURE() << "a directory was read as a config";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.string() + ": is a directory"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(TrainConfig, ErrorsNameFileAndField) {
  EXPECT_NE(error_of("[optim\nlr = 1").find("malformed TOML"), std::string::npos);
  std::string m = error_of("[optim]\nlearning_rate = 1e-3\n");
  EXPECT_NE(m.find("unknown key 'optim.learning_rate'"), std::string::npos) << m;
  m = error_of("[train]\nsteps = \"many\"\n");
  EXPECT_NE(m.find("train.steps: expected int, got a string"), std::string::npos) << m;
  m = error_of("[train]\nbatch_size = 6\ngrad_accum = 4\n");
  EXPECT_NE(m.find("train.grad_accum"), std::string::npos) << m;
  m = error_of("[memory]\nrecompute = \"some\"\n");
  EXPECT_NE(m.find("memory.recompute: must be none, full, every-k, sqrt, optimal or selective, got 'some'"), std::string::npos) << m;
  m = error_of("[memory]\nrecompute = \"optimal\"\n");
  EXPECT_NE(m.find("memory.activation_budget"), std::string::npos) << m;
  m = error_of("[train]\nskip_nonfinite = -1\n");
  EXPECT_NE(m.find("train.skip_nonfinite: must be non-negative, got -1"), std::string::npos) << m;
  // Each refusal names its own field (these named a neighbour, or none).
  for (const auto& [flag, want] : std::vector<std::pair<std::string, std::string>>{
           {"train.eval_batches=0", "train.eval_batches: must be positive, got 0"},
           {"optim.min_lr=-2", "optim.min_lr: must be non-negative, or -1 for optim.lr / 10, got -2"},
           {"optim.min_lr=0.001", "optim.min_lr: 0.001 is above optim.lr 0.0006: the decay would raise the learning rate"},
           {"optim.decay_steps=-1", "optim.decay_steps: must be non-negative (0: train.steps), got -1"},
           {"optim.beta2=-1", "optim.beta2: must lie in [0, 1), got -1"},
           {"train.sample_every=-1", "train.sample_every: must be non-negative, got -1"},
           {"train.out_dir=", "train.out_dir: must name a directory"}}) {
    m = error_of("", {flag});
    EXPECT_NE(m.find(want), std::string::npos) << flag << ": " << m;
  }
  m = error_of("[parallel]\nzero = 4\n");
  EXPECT_NE(m.find("parallel.zero"), std::string::npos) << m;
  m = error_of("[model]\npreset = \"gpt5\"\n");
  EXPECT_NE(m.find("gpt5"), std::string::npos) << m;
  m = error_of("", {"optim.lr=fast"});
  EXPECT_NE(m.find("--optim.lr"), std::string::npos) << m;
  m = error_of("", {"optim.nope=1"});
  EXPECT_NE(m.find("unknown key '--optim.nope'"), std::string::npos) << m;
  // An int list: a TOML array of integers, on the command line with or without brackets.
  m = error_of("[parallel]\nstage_layers = [1, \"two\"]\n");
  EXPECT_NE(m.find("parallel.stage_layers: expected int list, entry 1 is not an integer"), std::string::npos) << m;
  m = error_of("[parallel]\nstage_layers = 3\n");
  EXPECT_NE(m.find("parallel.stage_layers: expected int list, got an integer"), std::string::npos) << m;
  EXPECT_EQ(load_config("", {"parallel.pp=2", "model.n_layer=8", "parallel.stage_layers=3,5"}).stage_layers, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(load_config("", {"parallel.pp=2", "model.n_layer=8", "parallel.stage_layers=[1, 7]"}).stage_layers,
            (std::vector<int64_t>{1, 7}));
  EXPECT_THROW(collect_overrides({"--train.steps"}), Error);
  EXPECT_THROW(collect_overrides({"stray"}), Error);
  // A key of a megabyte is shown cut at 80 characters, with its length.
  m = error_of("", {std::string(1 << 20, 'k') + "=1"});
  EXPECT_NE(m.find("unknown key '--" + std::string(80, 'k') + "... (1048576 characters)'"), std::string::npos)
      << m.substr(0, 300);
  EXPECT_LT(m.size(), 300u);
  // A UTF-8 byte order mark before the text (as some editors write it) is not the config's.
  TmpFile bom("\xEF\xBB\xBF[train]\nsteps = 7\n");
  EXPECT_EQ(load_config(bom.path, {}).steps, 7);
  m = error_of("[train]\nsteps = 7 \xEF\xBB\xBF\n");  // (elsewhere it is a character outside a string)
  EXPECT_NE(m.find("not a TOML text file"), std::string::npos) << m;
}

TEST(TrainConfig, TomlRoundTrip) {
  TrainConfig c;
  c.lr = 1.5e-3f;
  c.out_dir = "runs/with \"quotes\" and \\";
  c.sp = true;
  c.seed = 99;
  c.cuda_graph = false;
  c.pp = 3;
  c.n_layer = 8;
  c.stage_layers = {3, 1, 4};
  c.prefetch = false;
  c.bias = false;  // an optional field set; tied_embeddings stays unset
  c.norm = "rmsnorm";
  c.rope_theta = 500000.f;
  TmpFile f(config_to_toml(c));
  TrainConfig d = load_config(f.path, {});
  EXPECT_EQ(config_to_toml(c), config_to_toml(d));
  EXPECT_EQ(d.out_dir, c.out_dir);
  EXPECT_FALSE(d.cuda_graph);
  EXPECT_EQ(d.stage_layers, (std::vector<int64_t>{3, 1, 4}));
  EXPECT_FALSE(d.prefetch);
  EXPECT_EQ(d.bias, std::optional<bool>(false));
  EXPECT_FALSE(d.tied_embeddings.has_value());
  EXPECT_EQ(d.norm, "rmsnorm");
  EXPECT_EQ(d.rope_theta, 500000.f);
  EXPECT_EQ(config_fields().size(), 80u);
}

// The README's config reference has a row for every field with its type, default and help, as
// `loom train --help-config` prints them.
TEST(TrainConfig, ReadmeListsEveryField) {
  std::ifstream f(std::string(LOOM_SOURCE_DIR) + "/README.md");
  ASSERT_TRUE(f.good()) << "README.md not found under " << LOOM_SOURCE_DIR;
  const std::string readme((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (const FieldInfo& fi : config_fields()) {
    const std::string row = fmt::format("| `{}` | {} | `{}` | {} |", fi.key, fi.type, fi.default_value, fi.help);
    EXPECT_NE(readme.find(row), std::string::npos) << "README.md lacks the row " << row;
  }
}

// GaLore projects whole matrices to a rank below their smaller side; embedding pruning keeps the
// loss only where lm_head is not the pruned table.
TEST(TrainConfig, GaLoreAndEmbeddingPruningRefusalsNameTheField) {
  const std::string galore = "[optim]\nname = \"galore\"\n", rank8 = galore + "galore_rank = 8\n";
  const std::string prune = "prune_embedding = true\n";
  const struct {
    std::string text, field, says;
  } cases[] = {
      {"[optim]\nname = \"lion\"\n", "optim.name", "'lion' is not adamw or galore"},
      {galore + "galore_rank = 0\n", "optim.galore_rank", "at least 1"},
      {galore + "galore_update_every = 0\n", "optim.galore_update_every", "at least 1"},
      {galore + "galore_scale = 0.0\n", "optim.galore_scale", "must be positive"},
      {galore + "galore_rank = 64\n[model]\npreset = \"gpt2-tiny\"\n", "optim.galore_rank", "not below the smaller side"},
      {rank8 + "[parallel]\ntp = 2\n", "parallel.tp", "needs whole matrices"},
      {rank8 + "[parallel]\nzero = 2\n", "parallel.zero", "needs whole matrices"},
      {rank8 + "[train]\ndevice = \"cuda\"\n", "optim.name", "CPU only"},
      {"[model]\npreset = \"gpt2-tiny\"\n" + prune, "model.tied_embeddings", "needs untied embeddings"},
      {"[model]\npreset = \"llama-tiny\"\n" + prune + "[parallel]\ntp = 2\n", "parallel.tp", "without tensor parallelism"},
  };
  for (const auto& c : cases) expect_refused(c.text, c.field, c.says);
}

// train.device = "cuda": every combination the GPU trainer lacks is refused naming the field, in
// any build; a build without CUDA refuses the device itself, saying how to build with it.
TEST(TrainConfig, CudaDeviceRefusalsNameTheField) {
  const std::string cuda = "[train]\ndevice = \"cuda\"\n";
  expect_refused("[train]\ndevice = \"gpu\"\n", "train.device", "'gpu' is not cpu, cuda or emu");
  expect_refused("[train]\ndevice = \"emu\"\nprecision = \"fp16\"\n", "train.precision",
                 "fp16 (f16 compute with loss scaling) runs on CUDA");
  // Whole replicas are processes: dp > 1 alone needs mpi or nccl (the mesh engine's ranks, with tp,
  // sp, ZeRO or offload, may be threads).
  expect_refused(cuda + "[parallel]\ndp = 2\n", "parallel.comm", "must be mpi or nccl");
  // Ring attention and selective recomputation call the kernels that keep no probabilities.
  expect_refused(cuda + "[parallel]\ncp = 2\n", "parallel.cp", "64 / 4 = 16");
  expect_refused(cuda + "cuda_attention = \"gemm\"\n[parallel]\ncp = 2\n[model]\nn_embd = 128\nn_head = 2\n",
                 "parallel.cp", "cuda_attention = gemm");
  expect_refused(cuda + "[memory]\nrecompute = \"selective\"\n", "memory.recompute", "64 / 4 = 16");
  expect_refused(cuda + "precision = \"fp16\"\n[parallel]\ntp = 2\n", "train.precision", "use bf16");
  expect_refused(cuda + "precision = \"fp16\"\n[parallel]\nzero = 1\ndp = 2\ncomm = \"mpi\"\n",
                 "train.precision", "use bf16");
  // fp16's loss scaling: a CUDA precision, with a positive scale, window and floor.
  expect_refused("[train]\nprecision = \"fp16\"\n", "train.precision", "runs on CUDA");
  expect_refused(cuda + "loss_scale_init = 0\n", "train.loss_scale_init", "must be positive");
  expect_refused(cuda + "loss_scale_window = 0\n", "train.loss_scale_window", "must be at least 1");
  expect_refused(cuda + "loss_scale_init = 1024\nloss_scale_min = 2048\n", "train.loss_scale_min",
                 "at most train.loss_scale_init 1024");
  expect_refused("[parallel]\ncomm = \"nccl\"\n", "parallel.comm", "needs train.device = \"cuda\"");
  expect_refused(cuda + "[parallel]\ncomm = \"gloo\"\n", "parallel.comm", "'gloo' is not threads, mpi or nccl");
  expect_refused(cuda + "[model]\nn_embd = 36\nn_head = 2\n", "model.n_embd", "multiple of 8");
  expect_refused(cuda + "[model]\nn_embd = 96\nn_head = 8\n", "model.n_head", "96 / 8 = 12");
  // Under tp the lm_head's GEMM is as wide as the rank's vocabulary shard.
  expect_refused(cuda + "[model]\nn_embd = 320\nn_head = 5\nvocab_size = 50257\n[parallel]\ntp = 5\n", "parallel.tp",
                 "padded vocabulary of 50304 rows into shards of 10061");
  // The vocabulary of a run is its data's unless the config sets one: checked again with it.
  {
    TrainConfig c;
    c.device = "cuda";
    c.tp = 3;
    model::GPTConfig m = model::gpt_preset("gpt2-tiny");
    m.vocab_size = 4096;  // padded 4096: shards of 1366
    try {
      c.validate_cuda_vocabulary(m, "data");
      ADD_FAILURE() << "tp 3 over 4096 rows was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("data: parallel.tp: 3 splits the padded vocabulary of 4096 rows into "
                                           "shards of 1366"),
                std::string::npos)
          << e.what();
    }
    c.tp = 2;
    EXPECT_NO_THROW(c.validate_cuda_vocabulary(m, "data"));
  }
  // The feed-forward's hidden width per rank, a GEMM width too.
  expect_refused(cuda + "[model]\npreset = \"llama-tiny\"\n[parallel]\ntp = 4\n", "parallel.tp",
                 "hidden width 176 into 44 per rank");
  expect_refused(cuda + "[model]\npreset = \"llama-tiny\"\nffn_hidden = 100\n", "model.ffn_hidden",
                 "must be a multiple of 8 with train.device = \"cuda\", got 100");
  expect_refused("[train]\ncuda_attention = \"xformers\"\n", "train.cuda_attention", "not auto, flash, cudnn or gemm");
  expect_refused(cuda + "cuda_attention = \"cudnn\"\n[model]\nn_embd = 128\nn_head = 4\n", "train.cuda_attention",
                 "128 / 4 = 32");
  // From the command line alone too.
  try {
    load_config("", collect_overrides({"--train.device", "cuda", "--parallel.cp=2", "--train.cuda_attention=gemm"}));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("command line: parallel.cp: "), std::string::npos) << e.what();
  }
  // Configs the GPU trainer takes (head size 16 uses the GEMM attention, 64 flash; data
  // parallelism over mpi or nccl processes; cp and selective recomputation at head size 64).
  for (const char* model : {"", "[model]\nn_embd = 128\nn_head = 2\n", "[parallel]\ndp = 2\ncomm = \"nccl\"\n",
                            "[parallel]\ndp = 4\ncomm = \"mpi\"\n",
                            "cuda_attention = \"cudnn\"\n[model]\nn_embd = 128\nn_head = 2\n",
                            "cuda_attention = \"gemm\"\n", "[parallel]\ntp = 2\n", "[parallel]\ntp = 2\nsp = true\n",
                            "[parallel]\ndp = 2\nzero = 2\n", "[parallel]\ndp = 2\ntp = 2\nzero = 1\noffload = true\n",
                            "[parallel]\ntp = 2\npp = 2\n", "[parallel]\ndp = 2\nzero = 3\n",
                            "[model]\nn_embd = 128\nn_head = 2\n[parallel]\ncp = 2\ntp = 2\n",
                            "[model]\nn_embd = 128\nn_head = 2\n[memory]\nrecompute = \"selective\"\n",
                            "[memory]\nrecompute = \"full\"\n"}) {
    TmpFile f(cuda + model);
#ifdef LOOM_HAVE_CUDA
    EXPECT_EQ(load_config(f.path, {}).device, "cuda");
#else
    expect_refused(cuda + model, "train.device", "-DLOOM_CUDA=ON");
#endif
  }
}

// run_training takes configs that did not come through load_config: it refuses the same way. In a
// build without CUDA "cuda" is refused naming the field; with CUDA the GPU's engine is there.
TEST(TrainConfig, RunTrainingChecksTheDevice) {
  TrainConfig c;
  c.data_dir = (fs::temp_directory_path() / fmt::format("loom_no_data_{}", ::getpid())).string();
  c.out_dir = c.data_dir + "_out";
  c.device = "cuda";
  c.cp = 2;
  try {
    run_training(c, {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.cp"), std::string::npos) << e.what();
  }
  c.cp = 1;
  try {
    run_training(c, {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
#ifdef LOOM_HAVE_CUDA
    // The GPU's engine is linked here: the device checks pass and the run stops at the data.
    EXPECT_NE(m.find(c.data_dir), std::string::npos) << m;
#else
    EXPECT_NE(m.find("train.device"), std::string::npos) << m;
    EXPECT_NE(m.find("-DLOOM_CUDA=ON"), std::string::npos) << m;
#endif
  }
  c.device = "tpu";
  try {
    run_training(c, {});
    ADD_FAILURE() << "device 'tpu' was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.device"), std::string::npos) << e.what();
  }
  fs::remove_all(c.out_dir);
}

// The outputs a run writes at its end are checked before it starts (a run of hours ended in
// "cannot write" and lost its loss curve): train.out_dir that is a file, --trace that is a folder
// or inside a file, each named; nothing is trained (the data is read after these checks), nothing
// is created, and an old run that --overwrite would replace is kept.
TEST(TrainConfig, RunTrainingChecksItsOutputsFirst) {
  const fs::path root = fs::temp_directory_path() / fmt::format("loom_outputs_{}", ::getpid());
  fs::remove_all(root);
  fs::create_directories(root / "folder");
  std::ofstream(root / "file") << "x";
  TrainConfig c;
  c.data_dir = (root / "no_data").string();
  auto error_of = [&](const std::string& out_dir, const std::string& trace) {
    c.out_dir = out_dir;
    TrainOptions o;
    o.trace_path = trace;
    try {
      run_training(c, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string file = (root / "file").string(), folder = (root / "folder").string();
  EXPECT_NE(error_of(file, "").find("train.out_dir = " + file + ": exists and is not a directory"), std::string::npos)
      << error_of(file, "");
  EXPECT_NE(error_of(file + "/run", "").find("train.out_dir = " + file + "/run: "), std::string::npos)
      << error_of(file + "/run", "");
  EXPECT_NE(error_of(file + "/run", "").find("cannot write into " + file + ": not a directory"), std::string::npos)
      << error_of(file + "/run", "");
  const std::string out = (root / "run").string();
  EXPECT_NE(error_of(out, folder).find("--trace = " + folder + ": is a directory, not a file to write"),
            std::string::npos)
      << error_of(out, folder);
  EXPECT_NE(error_of(out, file + "/t.json").find("--trace = " + file + "/t.json: cannot write into " + file +
                                                 ": not a directory"),
            std::string::npos)
      << error_of(out, file + "/t.json");
  // With good outputs the run gets as far as its data, and creates nothing before it is accepted.
  EXPECT_NE(error_of(out, (root / "traces/t.json").string()).find(c.data_dir), std::string::npos);
  EXPECT_FALSE(fs::exists(root / "traces"));
  EXPECT_FALSE(fs::exists(out));
  // --overwrite removes the old run only once the new one is accepted: not when its trace is a
  // folder, nor when its data is missing.
  fs::create_directories(out + "/ckpt_00000004");
  std::ofstream(out + "/latest") << "ckpt_00000004\n";
  std::ofstream(out + "/metrics.jsonl") << "{\"step\": 4, \"loss\": 1.0}\n";
  for (const std::string& trace : {folder, std::string()}) {
    c.out_dir = out;
    TrainOptions o;
    o.overwrite = true;
    o.trace_path = trace;
    EXPECT_THROW(run_training(c, o), Error);
    EXPECT_TRUE(fs::exists(out + "/latest")) << trace;
    EXPECT_TRUE(fs::exists(out + "/metrics.jsonl")) << trace;
    EXPECT_TRUE(fs::is_directory(out + "/ckpt_00000004")) << trace;
  }
  fs::remove_all(root);
}
