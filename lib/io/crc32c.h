// CRC-32C (Castagnoli), the checksum of the journal's records: detects any burst of up to 32
// flipped bits and all but 2^-32 of other damage.
#ifndef LORASTEP_LIB_IO_CRC32C_H_
#define LORASTEP_LIB_IO_CRC32C_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace lorastep {

// The CRC-32C of `data`, continuing from `crc` (0 to start); Crc32c("123456789") == 0xe3069283.
uint32_t Crc32c(absl::string_view data, uint32_t crc = 0);

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_CRC32C_H_
