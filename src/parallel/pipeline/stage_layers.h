// A pipeline's stages as transformer blocks per (virtual) stage, and the chain boundaries the
// executor cuts by (ExecutorOptions::cuts). The chain is the embedding (element 0), the blocks
// (1 .. n_layer) and the head (n_layer + 1); the first stage also holds the embedding and the
// last the head.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom::parallel::pipeline {

// Chain boundaries from the blocks of each stage in order. The first and the last stage may hold
// no block; every other stage holds at least one, and the blocks add up to n_layer. Throws naming
// `field` and the entry.
std::vector<int64_t> cuts_from_stage_layers(const std::vector<int64_t>& layers, int64_t n_layer,
                                            const std::string& field);
// The blocks of each stage of valid chain boundaries (the inverse of cuts_from_stage_layers).
std::vector<int64_t> stage_layers_from_cuts(const std::vector<int64_t>& cuts, int64_t n_layer);

}  // namespace loom::parallel::pipeline
