// LoRA factors drawn at random, for tests and benchmarks: a freshly created adapter has B = 0,
// which would hide the LoRA branch from anything that compares outputs.
#ifndef LORASTEP_TOOLS_RANDOM_LORA_H_
#define LORASTEP_TOOLS_RANDOM_LORA_H_

#include <cstdint>

#include "lib/model/adapter.h"

namespace lorastep {

// Every parameter of `adapter` drawn from N(0, scale^2), from `seed` alone.
void DrawLoraFactors(Adapter& adapter, uint64_t seed, double scale);

}  // namespace lorastep

#endif  // LORASTEP_TOOLS_RANDOM_LORA_H_
