// The element types lorastep's CUDA kernels take, named without CUDA headers so that C++
// callers (compiled by the host compiler) can pass them.
#ifndef LORASTEP_LIB_KERNELS_ELEMENT_TYPE_H_
#define LORASTEP_LIB_KERNELS_ELEMENT_TYPE_H_

namespace lorastep {
namespace kernels {

enum class ElementType { kFloat32, kBFloat16, kFloat16 };

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_ELEMENT_TYPE_H_
