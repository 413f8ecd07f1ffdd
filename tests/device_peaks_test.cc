// MFU's denominator by the name the CUDA driver reports (lib/device_peaks.h).
#include "lib/device_peaks.h"

#include "gtest/gtest.h"

namespace lorastep {
namespace {

TEST(DevicePeaksTest, KnownDevicesByTheirDriverNames) {
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA H200"), 989e12);
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA H100 PCIe"), 756e12) << "a PCIe H100 is not an SXM one";
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA L40S"), 362e12) << "not the L40's or the L4's";
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA L4"), 121e12);
}

TEST(DevicePeaksTest, AnUnknownDeviceHasNoPeak) {
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA GeForce RTX 4090"), 0);
  EXPECT_EQ(DenseBf16PeakFlops(""), 0) << "a CPU device or a build without CUDA";
}

}  // namespace
}  // namespace lorastep
