#include "lib/device_peaks.h"

namespace lorastep {

double DenseBf16PeakFlops(const std::string& device_name) {
  // Checked in order: the first name part found decides (an "H100 PCIe" before "H100").
  static const struct {
    const char* part;
    double flops;
  } kPeaks[] = {
      {"H200", 989e12},      {"H100 PCIe", 756e12}, {"H100 NVL", 835e12}, {"H100", 989e12},
      {"H800", 989e12},      {"B200", 2250e12},     {"B100", 1750e12},    {"A100", 312e12},
      {"A800", 312e12},      {"L40S", 362e12},      {"L40", 181e12},      {"L4", 121e12},
  };
  for (const auto& p : kPeaks) {
    if (device_name.find(p.part) != std::string::npos) return p.flops;
  }
  return 0;
}

}  // namespace lorastep
