// `loom train --resume` of mesh runs (tensor, sequence, context and pipeline parallelism): a run
// interrupted after the checkpoint of step 5 (LOOM_FAULT_INJECT makes a rank throw at the start
// of step 6) and resumed to step 10 equals the uninterrupted run of the same layout bit for bit
// (every loss, validation loss and gradient norm, and every tensor of the final checkpoint).
// Every rank writes its own slices of the full tensors, and every rank reads back just the
// elements it holds, so a checkpoint written under a layout resumes under any other (reshard on
// load); there the reduction order differs, so the losses are compared with the uninterrupted
// single-device run within 1e-5 relative (the tolerance of the layout tests,
// trainer_parallel_test.cpp). A
// checkpoint of another model is refused naming the manifest and the field.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <utility>

#include "model/gpt.h"
#include "train/checkpoint_io.h"
#include "train/mesh_train_util.h"

using namespace loom;
using namespace loom::test;

namespace {

const std::string kEvery5 = " --train.checkpoint_every 5 --train.keep_checkpoints 3";

class TrainParallelResume : public MeshTrainFixture {
 protected:
  // Runs `layout` into out until rank `rank` throws at the start of step 6 (after the checkpoint
  // of step 5), then checks what it left: any rank may fail, since no rank starts step 6 before
  // the step-5 checkpoint is on disk.
  static void run_interrupted(const std::string& out, const std::string& layout, int rank) {
    CmdRun cut = train(out, layout + kEvery5, fmt::format("LOOM_FAULT_INJECT=rank={},step=6,kind=throw", rank));
    ASSERT_NE(cut.status, 0) << layout << "\n" << cut.output;
    ASSERT_NE(cut.output.find(fmt::format("rank {} of", rank)), std::string::npos) << cut.output;
    ASSERT_NE(cut.output.find("fails on purpose at step 6"), std::string::npos) << cut.output;
    const std::string ckpt = train::latest_checkpoint((root_ / out).string());
    ASSERT_FALSE(ckpt.empty()) << cut.output;
    ASSERT_EQ(train::read_checkpoint_meta(ckpt).step, 5) << cut.output;
    ASSERT_EQ(metric(out, "loss").size(), 5u);
  }
  static void resume(const std::string& out, const std::string& layout) {
    CmdRun r = train(out, layout + kEvery5 + " --resume");
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.output;
  }

  // 10 steps straight == 5 steps, interrupted, then --resume to 10, under one layout.
  static void expect_bit_identical_resume(const std::string& name, const std::string& layout, int rank) {
    CmdRun straight = train(name + "_straight", layout + kEvery5);
    ASSERT_EQ(straight.status, 0) << layout << "\n" << straight.output;
    run_interrupted(name + "_cut", layout, rank);
    resume(name + "_cut", layout);
    expect_identical_metrics(name + "_straight", name + "_cut", {"loss", "val_loss", "grad_norm", "lr"});
    ASSERT_EQ(metric(name + "_cut", "loss").size(), 10u);
    expect_identical_checkpoints(name + "_straight", name + "_cut");
  }
};

}  // namespace

TEST_F(TrainParallelResume, TensorSequenceParallelResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("tp2_sp", "--parallel.tp 2 --parallel.sp true", 1);
}

TEST_F(TrainParallelResume, ContextParallelResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("cp2", "--parallel.cp 2", 0);
}

TEST_F(TrainParallelResume, PipelineTimesDataParallelResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("pp2_dp2", "--parallel.pp 2 --parallel.schedule 1f1b --parallel.dp 2", 1);
}

TEST_F(TrainParallelResume, ZeroOneWithTensorParallelResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("tp2_dp2_zero1", "--parallel.tp 2 --parallel.dp 2 --parallel.zero 1", 1);
  // Moments sharded over dp x cp (4 ranks).
  expect_bit_identical_resume("cp2_dp2_zero1", "--parallel.cp 2 --parallel.dp 2 --parallel.zero 1", 2);
}

// The 4D layout dp 2 x pp 2 x tp 2 resumes bit-identically too.
TEST_F(TrainParallelResume, DataPipelineTensorResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("dp2_pp2_tp2", "--parallel.dp 2 --parallel.pp 2 --parallel.tp 2", 3);
  expect_bit_identical_resume("dp2_pp2_zero1", "--parallel.dp 2 --parallel.pp 2 --parallel.zero 1", 2);
}

TEST_F(TrainParallelResume, TensorParallelCheckpointResumesUnderPipeline) {
  LOOM_REQUIRE_LOOM();
  run_interrupted("tp2_to_pp2", "--parallel.tp 2", 1);
  resume("tp2_to_pp2", "--parallel.pp 2 --parallel.schedule 1f1b");
  expect_losses_near_reference("tp2_to_pp2", "tp=2 steps 1-5, pp=2 steps 6-10");
}

TEST_F(TrainParallelResume, SingleDeviceCheckpointResumesUnderTensorParallel) {
  LOOM_REQUIRE_LOOM();
  run_interrupted("single_to_tp2", "", 0);
  resume("single_to_tp2", "--parallel.tp 2");
  expect_losses_near_reference("single_to_tp2", "single device steps 1-5, tp=2 steps 6-10");
}

TEST_F(TrainParallelResume, PipelineCheckpointResumesUnderDataParallel) {
  LOOM_REQUIRE_LOOM();
  run_interrupted("pp2_to_dp2", "--parallel.pp 2", 1);
  resume("pp2_to_dp2", "--parallel.dp 2");
  expect_losses_near_reference("pp2_to_dp2", "pp=2 steps 1-5, dp=2 steps 6-10");
}

// ZeRO-3 shards the parameters themselves: each rank writes and reads its shard.
TEST_F(TrainParallelResume, ZeroThreeResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("dp2_zero3", "--parallel.dp 2 --parallel.zero 3", 1);
}

// And in a pipeline, where each stage's ranks write and read their shards of the stage (the last
// stage's copy of the tied wte read from wte).
TEST_F(TrainParallelResume, PipelineZeroThreeResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("pp2_dp2_zero3", "--parallel.pp 2 --parallel.dp 2 --parallel.zero 3", 3);
}

// A checkpoint written under one layout resumes under another: the pairs of the resharding
// acceptance, each from its own interrupted run.
TEST_F(TrainParallelResume, CheckpointsReshardBetweenLayouts) {
  LOOM_REQUIRE_LOOM();
  // dp 4 needs one micro-batch of the 4 sequences: that pair runs with train.grad_accum 1 on both
  // sides (which also sets the validation batch), against a single-device run of the same.
  const std::string ga1 = " --train.grad_accum 1";
  CmdRun ref = train("ref_ga1", ga1);
  ASSERT_EQ(ref.status, 0) << ref.output;
  // The Llama family with 2 key/value heads: under tp 4 each is replicated on two ranks, whose
  // first writes it.
  const std::string llama = " --model.preset llama-tiny";
  CmdRun ref_llama = train("ref_llama", llama);
  ASSERT_EQ(ref_llama.status, 0) << ref_llama.output;
  const struct {
    std::string name, from, to, ref;
  } pairs[] = {
      {"pp2tp2_to_dp4z3", "--parallel.pp 2 --parallel.tp 2" + ga1, "--parallel.dp 4 --parallel.zero 3" + ga1, "ref_ga1"},
      {"single_to_tp4", "", "--parallel.tp 4", ""},
      {"dp2z3_to_single", "--parallel.dp 2 --parallel.zero 3", "", ""},
      {"pp2dp2z2_to_tp2dp2z3", "--parallel.pp 2 --parallel.dp 2 --parallel.zero 2",
       "--parallel.tp 2 --parallel.dp 2 --parallel.zero 3",
       ""},
      {"cp2tp2_to_pp2dp2", "--parallel.cp 2 --parallel.tp 2", "--parallel.pp 2 --parallel.dp 2", ""},
      {"ipp2_to_tp2", "--parallel.pp 2 --parallel.schedule interleaved --parallel.virtual_stages 2", "--parallel.tp 2",
       ""},
      {"llama_tp4_to_tp2dp2", "--parallel.tp 4" + llama, "--parallel.tp 2 --parallel.dp 2 --parallel.zero 2" + llama,
       "ref_llama"},
      {"llama_single_to_tp4pp2", llama, "--parallel.tp 4 --parallel.pp 2 --parallel.sp true" + llama, "ref_llama"},
  };
  for (const auto& p : pairs) {
    run_interrupted(p.name, p.from, 0);
    resume(p.name, p.to);
    expect_losses_near_reference(p.name, fmt::format("[{}] steps 1-5, [{}] steps 6-10", p.from, p.to), 10, p.ref);
  }
}

TEST_F(TrainParallelResume, ConvertAndGenerateReadAShardedCheckpoint) {
  LOOM_REQUIRE_LOOM();
  CmdRun r = train("sharded", "--parallel.tp 2 --parallel.dp 2 --parallel.zero 3 --train.steps 2");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string sharded = train::latest_checkpoint((root_ / "sharded").string());
  ASSERT_TRUE(fs::exists(fs::path(sharded) / "rank_00003.safetensors"));
  // The same state through the one-writer path.
  const train::CheckpointMeta meta = train::read_checkpoint_meta(sharded);
  MemoryPool pool("whole");
  std::vector<train::NamedTensor> whole;
  for (auto& [name, v] : checkpoint_tensors(sharded)) {
    train::CheckpointReader reader(sharded);
    Tensor t = Tensor::empty(reader.shape(name), DType::f32, MemTag::workspace, pool);
    std::copy(v.begin(), v.end(), t.f32());
    whole.push_back({name, t});
  }
  const std::string one = train::save_checkpoint((root_ / "whole").string(), meta, whole);
  for (const auto& [ckpt, out] : {std::pair{sharded, "hf_sharded"}, std::pair{one, "hf_whole"}}) {
    CmdRun c = sh(fmt::format("{} convert --from loom --to hf '{}' '{}'", kLoom, ckpt, (root_ / out).string()));
    ASSERT_EQ(c.status, 0) << c.output;
  }
  auto bytes = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string a = bytes(root_ / "hf_sharded" / "model.safetensors");
  EXPECT_GT(a.size(), 10000u);
  EXPECT_EQ(a, bytes(root_ / "hf_whole" / "model.safetensors"));
  const std::string gen = " --ids --prompt '5 17 20' --tokens 12 --top-k 20 --seed 4 --quiet";
  CmdRun ga = sh(fmt::format("OMP_NUM_THREADS=1 {} generate '{}'{}", kLoom, sharded, gen));
  CmdRun gb = sh(fmt::format("OMP_NUM_THREADS=1 {} generate '{}'{}", kLoom, one, gen));
  ASSERT_EQ(ga.status, 0) << ga.output;
  ASSERT_EQ(gb.status, 0) << gb.output;
  EXPECT_EQ(ga.output, gb.output);
}

// GaLore's state (moments in the subspace, projectors) is checkpointed and read back: a resume
// equals the straight run bit for bit, on one device and under pp 2 x dp 2 (where the data-
// parallel ranks share the writing of the state each holds whole), and a checkpoint written
// under one layout resumes under another.
TEST_F(TrainParallelResume, GaLoreResumesBitIdenticallyAndReshards) {
  LOOM_REQUIRE_LOOM();
  const std::string galore = " --optim.name galore --optim.galore_rank 8 --optim.galore_update_every 3";
  expect_bit_identical_resume("galore_single", galore, 0);
  expect_bit_identical_resume("galore_pp2_dp2", "--parallel.pp 2 --parallel.dp 2" + galore, 2);
  const std::string ckpt = train::latest_checkpoint((root_ / "galore_single_cut").string());
  {
    train::CheckpointReader reader(ckpt);
    EXPECT_EQ(reader.shape("galore_m/h.0.attn.c_attn.weight"), (Shape{96, 8}));
    EXPECT_EQ(reader.shape("galore_p/h.0.attn.c_attn.weight"), (Shape{8, 32}));
    EXPECT_EQ(reader.shape("galore_v/h.1.mlp.c_proj.weight"), (Shape{8, 128}));
    EXPECT_EQ(reader.shape("galore_p/h.1.mlp.c_proj.weight"), (Shape{32, 8}));
    EXPECT_FALSE(reader.has("adam_m/h.0.attn.c_attn.weight"));
    EXPECT_EQ(reader.shape("adam_m/wte.weight"), (Shape{97, 32}));
  }
  // A Llama block's fused q/k/v and gate/up as Hugging Face's modules, each with its own state:
  // q [32, 32] and gate, up [128, 32] on the right, k and v [16, 32] (2 key/value heads) on the left.
  const std::string llama =
      " --model.norm rmsnorm --model.mlp swiglu --model.position rope --model.n_kv_head 2 --model.bias false "
      "--model.tied_embeddings false";
  expect_bit_identical_resume("galore_llama", llama + galore, 0);
  {
    train::CheckpointReader reader(train::latest_checkpoint((root_ / "galore_llama_cut").string()));
    EXPECT_EQ(reader.shape("galore_m/h.0.attn.c_attn.weight[q]"), (Shape{32, 8}));
    EXPECT_EQ(reader.shape("galore_p/h.0.attn.c_attn.weight[k]"), (Shape{16, 8}));
    EXPECT_EQ(reader.shape("galore_v/h.0.attn.c_attn.weight[v]"), (Shape{8, 32}));
    EXPECT_EQ(reader.shape("galore_m/h.1.mlp.c_fc.weight[up]"), (Shape{128, 8}));
    EXPECT_FALSE(reader.has("galore_m/h.0.attn.c_attn.weight"));
    EXPECT_EQ(reader.shape("galore_m/h.1.mlp.c_proj.weight"), (Shape{8, 128}));
  }
  ASSERT_EQ(train("galore_ref", galore).status, 0);
  run_interrupted("galore_dp2_to_pp2", "--parallel.dp 2" + galore, 1);
  resume("galore_dp2_to_pp2", "--parallel.pp 2" + galore);
  expect_losses_near_reference("galore_dp2_to_pp2", "galore dp=2 steps 1-5, pp=2 steps 6-10", 10, "galore_ref");
  // A checkpoint of one optimizer after its first step does not resume under the other (naming
  // the field); a run may start GaLore from one at step 0 (as `loom convert` writes them).
  CmdRun other = train("galore_single_cut", " --resume");
  EXPECT_NE(other.status, 0) << other.output;
  EXPECT_NE(other.output.find("this run's optim.name = adamw"), std::string::npos) << other.output;
  EXPECT_NE(other.output.find("GaLore's, moments [96, 8]"), std::string::npos) << other.output;
  CmdRun rank = train("galore_single_cut", galore + " --optim.galore_rank 4 --resume");
  EXPECT_NE(rank.status, 0) << rank.output;
  EXPECT_NE(rank.output.find("optim.galore_rank 4"), std::string::npos) << rank.output;
  // Its refresh interval and scale are the run's too (they had been taken silently).
  CmdRun scale = train("galore_single_cut", galore + " --optim.galore_scale 4 --optim.galore_update_every 2 --resume");
  EXPECT_NE(scale.status, 0) << scale.output;
  EXPECT_NE(scale.output.find("optim.galore_update_every 2 (the checkpoint's 3); optim.galore_scale 4 (the "
                              "checkpoint's 0.25)"),
            std::string::npos)
      << scale.output;
  // GaLore's fields without optim.name = galore are said to be unused.
  CmdRun unused = train_steps("galore_unused", " --optim.galore_rank 4", 1);
  EXPECT_EQ(unused.status, 0) << unused.output;
  EXPECT_NE(unused.output.find("optim.galore_rank = 4 set, but optim.name = adamw: it applies only with "
                               "optim.name = galore"),
            std::string::npos)
      << unused.output;
}

// Embedding pruning (model.prune_embedding): a fine-tune from a checkpoint of the whole
// vocabulary, on a corpus that uses a third of it, with the input embedding cut to the rows of
// those tokens, gives the losses of the same fine-tune with the whole table (the untied lm_head
// still scores every token), on one device and under pp 2 x dp 2 with ZeRO-1, while its
// parameters, gradients and moments hold that fraction of the table's bytes. The checkpoints
// keep the trained rows and their token ids; export and generation map them back onto the rows
// the run started from.
TEST_F(TrainParallelResume, PrunedEmbeddingFineTuneGivesTheWholeTablesLosses) {
  LOOM_REQUIRE_LOOM();
  // The fine-tuning corpus: ids 0, 3, ..., 96 only (33 of 97).
  const fs::path sub = root_ / "data_sub";
  fs::create_directories(sub);
  std::mt19937 g(5);
  std::vector<uint32_t> toks(6000);
  for (auto& t : toks) t = 3 * (g() % 33);
  data::write_shard((sub / "train_000.bin").string(), toks, 97);
  data::write_shard((sub / "val_000.bin").string(), std::vector<uint32_t>(toks.begin(), toks.begin() + 1000), 97);
  const int64_t K = 33, C = 32, Vpad = 128;
  const std::string untied = " --model.tied_embeddings false", ft = untied + " --data.dir " + sub.string() + " --resume --new-hparams";
  CmdRun base = train_steps("prune_base", untied, 3);
  ASSERT_EQ(base.status, 0) << base.output;
  for (const std::string layout : {"", " --parallel.pp 2 --parallel.dp 2 --parallel.zero 1"}) {
    const std::string full = "prune_full" + std::to_string(layout.size()), cut = "prune_cut" + std::to_string(layout.size());
    for (const std::string& d : {full, cut}) {
      fs::remove_all(root_ / d);
      fs::copy(root_ / "prune_base", root_ / d, fs::copy_options::recursive);
    }
    CmdRun a = train(full, layout + ft);
    ASSERT_EQ(a.status, 0) << a.output;
    CmdRun b = train(cut, layout + ft + " --model.prune_embedding true");
    ASSERT_EQ(b.status, 0) << b.output;
    // (Bit-identical here; the acceptance asks 1e-5.)
    expect_identical_metrics(full, cut, {"loss", "val_loss", "grad_norm"});
    if (!layout.empty()) continue;
    // One device: every tag by the table's pruned rows exactly (params, grads: 4 bytes a value;
    // the AdamW moments 8).
    auto peaks = [&](const std::string& out) {
      std::ifstream f(root_ / out / "memory.json");
      return nlohmann::json::parse(f).at("ranks").at(0).at("peak_bytes");
    };
    const nlohmann::json pa = peaks(full), pb = peaks(cut);
    for (const auto& [tag, per] : {std::pair<const char*, int64_t>{"params", 4}, {"grads", 4}, {"optimizer", 8}})
      EXPECT_EQ(pa.at(tag).get<int64_t>() - pb.at(tag).get<int64_t>(), (Vpad - K) * C * per) << tag;
    // The checkpoint: the kept rows and their ids; mapped back, the kept rows are the trained
    // ones and the others the starting point's.
    const std::string ckpt = train::latest_checkpoint((root_ / cut).string());
    const auto tensors = checkpoint_tensors(ckpt);
    ASSERT_EQ(tensors.at("vocab/kept").size(), size_t(K));
    ASSERT_EQ(tensors.at("param/wte.weight").size(), size_t(K * C));
    const auto start = checkpoint_tensors(train::latest_checkpoint((root_ / "prune_base").string()));
    MemoryPool pool("export");
    model::GPT gpt(model::checkpoint_model_config(ckpt), pool);
    model::load_checkpoint_params(ckpt, gpt);
    const float* wte = gpt.parameters().front()->value.f32();
    for (int64_t id = 0; id < 97; ++id)
      for (int64_t c = 0; c < C; ++c) {
        const float want = id % 3 == 0 ? tensors.at("param/wte.weight")[size_t(id / 3 * C + c)]
                                       : start.at("param/wte.weight")[size_t(id * C + c)];
        ASSERT_EQ(wte[id * C + c], want) << "token " << id << " column " << c;
      }
    CmdRun gen = sh(fmt::format("{} generate {} --ids --prompt '0 3 6' --tokens 5 --quiet", kLoom, (root_ / cut).string()));
    EXPECT_EQ(gen.status, 0) << gen.output;
    // Exported to Hugging Face's GPT-2 layout (untied): the same whole table.
    const fs::path hf = root_ / "prune_hf";
    fs::remove_all(hf);
    CmdRun exp = sh(fmt::format("{} convert --from loom --to hf {} {}", kLoom, (root_ / cut).string(), hf.string()));
    ASSERT_EQ(exp.status, 0) << exp.output;
    const std::vector<float> exported = train::SafetensorsReader((hf / "model.safetensors").string()).read_f32("wte.weight");
    ASSERT_EQ(exported.size(), size_t(97 * C));
    EXPECT_EQ(std::memcmp(exported.data(), wte, exported.size() * sizeof(float)), 0);
  }
  // Refused, naming the field: a tied embedding, a run without a checkpoint, a pruned checkpoint
  // resumed without the option, a pruned run resumed on other data.
  CmdRun tied = train("prune_tied", " --model.prune_embedding true");
  EXPECT_NE(tied.output.find("model.tied_embeddings: model.prune_embedding needs untied embeddings"), std::string::npos)
      << tied.output;
  CmdRun fresh = train("prune_fresh", untied + " --model.prune_embedding true");
  EXPECT_NE(fresh.output.find("model.prune_embedding fine-tunes a checkpoint"), std::string::npos) << fresh.output;
  CmdRun whole = train("prune_cut0", ft + " --train.steps 12");
  EXPECT_NE(whole.output.find("resume it with --model.prune_embedding true"), std::string::npos) << whole.output;
  CmdRun other = train("prune_cut0", untied + " --resume --model.prune_embedding true --train.steps 12");
  EXPECT_NE(other.output.find("but data.dir"), std::string::npos) << other.output;
  // A damaged pruned_rows.safetensors (the rows the run does not train): a NaN, or a flipped bit
  // that leaves a finite value, is refused naming the file by generation, export and --resume.
  const auto damaged = [&](const std::string& out, int64_t element, const std::function<void(uint32_t&)>& change) {
    fs::remove_all(root_ / out);
    fs::copy(root_ / "prune_cut0", root_ / out, fs::copy_options::recursive);
    const fs::path rows = root_ / out / "pruned_rows.safetensors";
    const train::SafetensorsReader r(rows.string());
    std::fstream f(rows, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header = 0;
    f.read(reinterpret_cast<char*>(&header), 8);
    const std::streamoff at = std::streamoff(8 + header + r.entry("wte.weight").begin + uint64_t(element) * 4);
    uint32_t bits = 0;
    f.seekg(at);
    f.read(reinterpret_cast<char*>(&bits), 4);
    change(bits);
    f.seekp(at);
    f.write(reinterpret_cast<const char*>(&bits), 4);
    ASSERT_TRUE(f.good());
  };
  damaged("prune_nan", 1 * C, [](uint32_t& b) { b = 0x7fc00000u; });  // token 1 (not kept), column 0
  damaged("prune_flip", 2 * C + 5, [](uint32_t& b) { b ^= 1u << 3; });
  const std::string nan_rows = (root_ / "prune_nan" / "pruned_rows.safetensors").string();
  CmdRun gen_nan = sh(fmt::format("{} generate {} --ids --prompt '0 3' --tokens 2", kLoom, (root_ / "prune_nan").string()));
  EXPECT_NE(gen_nan.status, 0);
  EXPECT_NE(gen_nan.output.find(nan_rows + ": tensor 'wte.weight' holds nan at index " + std::to_string(C)),
            std::string::npos)
      << gen_nan.output;
  const std::string flip_rows = (root_ / "prune_flip" / "pruned_rows.safetensors").string();
  CmdRun exp_flip = sh(fmt::format("{} convert --from loom --to hf {} {}", kLoom, (root_ / "prune_flip").string(),
                                   (root_ / "prune_flip_hf").string()));
  EXPECT_NE(exp_flip.status, 0);
  EXPECT_NE(exp_flip.output.find(flip_rows + ": tensor 'wte.weight' does not match the file's CRC-32"), std::string::npos)
      << exp_flip.output;
  CmdRun res_flip = train("prune_flip", ft + " --model.prune_embedding true --train.steps 12");
  EXPECT_NE(res_flip.status, 0);
  EXPECT_NE(res_flip.output.find(flip_rows + ": tensor 'wte.weight' does not match the file's CRC-32"), std::string::npos)
      << res_flip.output;
}

TEST_F(TrainParallelResume, CheckpointOfAnotherModelIsRefusedNamingTheField) {
  LOOM_REQUIRE_LOOM();
  CmdRun first = train("other_model", "--parallel.tp 2 --train.steps 1");
  ASSERT_EQ(first.status, 0) << first.output;
  for (const std::string layout : {"--parallel.tp 2", "--parallel.pp 2", ""}) {
    CmdRun r = train("other_model", layout + " --model.n_embd 64 --resume");
    EXPECT_NE(r.status, 0) << layout << "\n" << r.output;
    EXPECT_NE(r.output.find("manifest.json"), std::string::npos) << layout << "\n" << r.output;
    EXPECT_NE(r.output.find("model.n_embd is 32 but this run's is 64"), std::string::npos) << layout << "\n"
                                                                                            << r.output;
  }
  CmdRun seed = train("other_model", "--parallel.tp 2 --train.seed 7 --resume");
  EXPECT_NE(seed.status, 0) << seed.output;
  EXPECT_NE(seed.output.find("train.seed"), std::string::npos) << seed.output;
}
