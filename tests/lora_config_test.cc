// Tinker's train_attn / train_mlp / train_unembed switches and the target modules they stand for.
#include "lib/model/lora_config.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace lorastep {
namespace {

TEST(LoraConfigTest, SwitchesRoundTripThroughTargets) {
  for (int bits = 1; bits < 8; ++bits) {
    const bool attn = bits & 1, mlp = bits & 2, unembed = bits & 4;
    absl::StatusOr<std::vector<std::string>> targets = TargetsFromSwitches(attn, mlp, unembed);
    ASSERT_TRUE(targets.ok()) << targets.status();
    const std::optional<TinkerSwitches> back = SwitchesFromTargets(*targets);
    ASSERT_TRUE(back.has_value()) << bits;
    EXPECT_EQ(back->train_attn, attn);
    EXPECT_EQ(back->train_mlp, mlp);
    EXPECT_EQ(back->train_unembed, unembed);
  }
  EXPECT_FALSE(TargetsFromSwitches(false, false, false).ok());
}

TEST(LoraConfigTest, AllLinearIsAttentionAndMlp) {
  const std::optional<TinkerSwitches> s = SwitchesFromTargets({"all-linear", "lm_head"});
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->train_attn && s->train_mlp && s->train_unembed);
}

TEST(LoraConfigTest, TargetsTheSwitchesCannotSayHaveNone) {
  EXPECT_FALSE(SwitchesFromTargets({"q_proj"}).has_value());                               // part of attention
  EXPECT_FALSE(SwitchesFromTargets({"gate_proj", "up_proj"}).has_value());                // part of the MLP
  EXPECT_FALSE(SwitchesFromTargets({"q_proj", "k_proj", "v_proj", "o_proj", "foo"}).has_value());
  EXPECT_FALSE(SwitchesFromTargets({}).has_value());
}

}  // namespace
}  // namespace lorastep
