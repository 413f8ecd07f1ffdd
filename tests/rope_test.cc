// RoPE variants (lib/model/rope.h) by what each promises, independent of how it is computed:
// linear divides every frequency by the factor; dynamic is default up to its original
// length and lowers the frequencies past it; llama3 keeps the high frequencies, divides the
// low ones by the factor and blends between; yarn keeps the highest, interpolates the
// lowest and scales cos and sin by its attention factor. (Their values against transformers'
// own are checked on the GPU: bench/families.py.)
#include "lib/model/rope.h"

#include <ATen/ATen.h>

#include <cmath>

#include "gtest/gtest.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

ModelConfig Config(const std::string& type, double factor = 4) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.head_dim_override = 64;  // 32 frequencies: every band is populated
  c.rope_theta = 500000;
  c.max_position_embeddings = 256;
  c.rope.type = type;
  c.rope.factor = factor;
  return c;
}

// The default frequencies of Config()'s shape, which every variant here shares.
at::Tensor Default() { return RopeFrequencies(Config("default"), 1).first; }

TEST(RopeTest, DefaultIsThetaToTheMinusTwoJOverD) {
  const ModelConfig c = Config("default");
  const auto [inv, scale] = RopeFrequencies(c, 10);
  EXPECT_EQ(scale, 1.0);
  ASSERT_EQ(inv.size(0), 32);
  for (int j = 0; j < 32; ++j) EXPECT_NEAR(inv[j].item<double>(), std::pow(5e5, -2.0 * j / 64), 1e-6 * std::pow(5e5, -2.0 * j / 64));
}

TEST(RopeTest, LinearDividesEveryFrequency) {
  const auto [inv, scale] = RopeFrequencies(Config("linear"), 10);
  EXPECT_TRUE(at::allclose(inv * 4, Default(), 1e-6, 0));
  EXPECT_EQ(scale, 1.0);
}

TEST(RopeTest, DynamicIsDefaultUpToItsOriginalLengthAndSlowerPastIt) {
  const ModelConfig c = Config("dynamic");
  EXPECT_TRUE(at::equal(RopeFrequencies(c, 256).first, Default()));
  const at::Tensor longer = RopeFrequencies(c, 1024).first;
  EXPECT_EQ(longer[0].item<double>(), 1.0);  // the first pair never rotates slower
  EXPECT_TRUE((longer.narrow(0, 1, 31) < Default().narrow(0, 1, 31)).all().item<bool>());
  // The base grows as (factor * n / original - (factor - 1)) ^ (d / (d - 2)): n = 1024 -> 13.
  const double base = 5e5 * std::pow(13.0, 64.0 / 62.0);
  EXPECT_NEAR(longer[31].item<double>(), std::pow(base, -62.0 / 64), 1e-6 * std::pow(base, -62.0 / 64));
  // A table past the original length is the one of its own length, not a prefix of a longer one.
  const auto [cos_a, sin_a] = RopeTables(c, 1024, at::kFloat);
  const auto [cos_b, sin_b] = RopeTables(c, 2048, at::kFloat);
  EXPECT_FALSE(at::allclose(cos_a, cos_b.narrow(0, 0, 1024)));
}

TEST(RopeTest, Llama3KeepsHighDividesLowAndBlendsBetween) {
  ModelConfig c = Config("llama3", 8);
  c.rope.original_max_position_embeddings = 256;
  const at::Tensor inv = RopeFrequencies(c, 10).first, plain = Default();
  int high = 0, low = 0, between = 0;
  for (int j = 0; j < 32; ++j) {
    const double wavelen = 2 * M_PI / plain[j].item<double>();
    const double got = inv[j].item<double>(), was = plain[j].item<double>();
    if (wavelen < 256.0 / 4) {
      EXPECT_EQ(got, was) << j;
      ++high;
    } else if (wavelen > 256.0 / 1) {
      EXPECT_NEAR(got, was / 8, 1e-6 * was) << j;
      ++low;
    } else {
      EXPECT_LE(got, was) << j;
      EXPECT_GE(got, was / 8) << j;
      ++between;
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(between, 0);
}

TEST(RopeTest, YarnKeepsTheHighestInterpolatesTheLowestAndScales) {
  const ModelConfig c = Config("yarn");
  const auto [inv, scale] = RopeFrequencies(c, 10);
  const at::Tensor plain = Default();
  EXPECT_NEAR(scale, 0.1 * std::log(4.0) + 1, 1e-12);
  EXPECT_NEAR(inv[0].item<double>(), plain[0].item<double>(), 1e-7);
  EXPECT_NEAR(inv[31].item<double>(), plain[31].item<double>() / 4, 1e-6 * plain[31].item<double>());
  const auto [cos, sin] = RopeTables(c, 64, at::kFloat);
  EXPECT_TRUE(at::allclose(cos * cos + sin * sin, at::full_like(cos, scale * scale), 1e-5, 1e-6));
  ModelConfig given = c;
  given.rope.attention_factor = 0.5;
  EXPECT_EQ(RopeFrequencies(given, 10).second, 0.5);
}

}  // namespace
}  // namespace lorastep
