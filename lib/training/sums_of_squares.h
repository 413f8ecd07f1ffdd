// Squared norms in fp64 for several groups of tensors at once: each co-scheduled run's
// gradient norm (a group of its grad buckets) in one pass over all of them.
#ifndef LORASTEP_LIB_TRAINING_SUMS_OF_SQUARES_H_
#define LORASTEP_LIB_TRAINING_SUMS_OF_SQUARES_H_

#include <ATen/ATen.h>

#include <vector>

namespace lorastep {

// +- the sum of the squares of `values`' elements (undefined: nothing).
struct SquareTerm {
  at::Tensor values;
  bool negative = false;
};

// A [groups.size()] fp64 tensor: for each group, 0 plus its terms in order. On CUDA (every
// defined term a contiguous fp32 tensor on one GPU, lorastep's kernels built) one launch covers
// every group, on that GPU, and a group's value does not depend on the others; elsewhere each
// term is converted to fp64, squared and summed (ATen), on `device`.
at::Tensor GroupSumsOfSquares(const std::vector<std::vector<SquareTerm>>& groups, const at::Device& device);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_SUMS_OF_SQUARES_H_
