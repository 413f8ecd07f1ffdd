// Tinker's train_attn / train_mlp / train_unembed switches and the target modules they stand for.
#include "lib/model/lora_config.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

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

// Attention is every layer's token mixer: the Gated DeltaNet projections (the group
// linear_attn, or all five as a checkpoint of a hybrid model lists them) go with q/k/v/o.
TEST(LoraConfigTest, LinearAttentionProjectionsBelongToAttention) {
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> attn, TargetsFromSwitches(true, false, false));
  EXPECT_EQ(attn, (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "linear_attn"}));
  LoraConfig lora;
  lora.rank = 4;
  lora.target_modules = attn;
  ASSERT_OK_AND_ASSIGN(auto targeted, ResolveLoraTargets(lora));
  for (int s = 0; s < kNumLinearSlots; ++s) EXPECT_EQ(targeted[s], s < kGateProj || s >= kInProjQkv) << s;
  // As PEFT lists them: the five by name on a hybrid model, none on another.
  EXPECT_EQ(LoraTargetModuleNames(lora, /*linear_attention=*/true).value().size(), 9u);
  EXPECT_EQ(LoraTargetModuleNames(lora, /*linear_attention=*/false).value(),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  const std::vector<std::string> listed = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv",
                                           "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "lm_head"};
  const std::optional<TinkerSwitches> s = SwitchesFromTargets(listed);
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->train_attn && !s->train_mlp && s->train_unembed);
  EXPECT_FALSE(SwitchesFromTargets({"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv"}).has_value());  // some
  EXPECT_FALSE(SwitchesFromTargets({"linear_attn", "gate_proj", "up_proj", "down_proj"}).has_value());  // no q/k/v/o
}

TEST(LoraConfigTest, TargetsTheSwitchesCannotSayHaveNone) {
  EXPECT_FALSE(SwitchesFromTargets({"q_proj"}).has_value());                               // part of attention
  EXPECT_FALSE(SwitchesFromTargets({"gate_proj", "up_proj"}).has_value());                // part of the MLP
  EXPECT_FALSE(SwitchesFromTargets({"q_proj", "k_proj", "v_proj", "o_proj", "foo"}).has_value());
  EXPECT_FALSE(SwitchesFromTargets({}).has_value());
}

}  // namespace
}  // namespace lorastep
