// The dense bf16 tensor-core peak of a CUDA device, by the name the driver reports
// (cudaDeviceProp::name, e.g. "NVIDIA H200"): MFU's denominator. Datasheet figures, without
// sparsity. A device that is not in the table has no peak (0): MFU is then reported as 0 and
// the worker's log names the device.
#ifndef LORASTEP_LIB_DEVICE_PEAKS_H_
#define LORASTEP_LIB_DEVICE_PEAKS_H_

#include <string>

namespace lorastep {

// FLOP/s; 0 for an unknown device.
double DenseBf16PeakFlops(const std::string& device_name);

}  // namespace lorastep

#endif  // LORASTEP_LIB_DEVICE_PEAKS_H_
