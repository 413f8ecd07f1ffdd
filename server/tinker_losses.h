// The Tinker SDK's losses in lorastep's terms, for the Tinker-compatible front: a
// forward_backward's `loss_fn` and `loss_fn_config` become the LossConfig the coordinator
// runs. Tinker's token losses are sums (normalization `sum`); with lp the learner's log-prob
// of the target, q the datum's `logprobs`, r = exp(lp - q) and A its `advantages`:
//   cross_entropy         -lp * w (the datum's `weights`)          no config
//   importance_sampling   -r * A                                   no config
//   ppo                   -min(r * A, clip(r, lo, hi) * A)         clip_low_threshold (0.8), clip_high_threshold (1.2)
//   cispo                 -stopgrad(clip(r, lo, hi)) * lp * A      clip_low_threshold (0.8), clip_high_threshold (1.2)
//   dro                   -(lp * A - beta / 2 * (lp - q)^2)        beta (0.05)
// A key the loss does not take, or a value outside its range, is INVALID_ARGUMENT naming
// `loss_fn_config.<key>`; an unknown loss names `loss_fn`.
#ifndef LORASTEP_SERVER_TINKER_LOSSES_H_
#define LORASTEP_SERVER_TINKER_LOSSES_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "lorastep/v1/trainer.pb.h"

namespace lorastep {

absl::StatusOr<v1::LossConfig> LossConfigFromTinker(const std::string& loss_fn,
                                                    const std::map<std::string, double>& loss_fn_config);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_TINKER_LOSSES_H_
