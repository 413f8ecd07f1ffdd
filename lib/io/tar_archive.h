// A folder as a POSIX tar archive (ustar), streamed to a sink: how a checkpoint (a PEFT
// adapter folder) leaves the state store as one download.
//
// The archive holds the folder's regular files and subfolders, in name order (hidden ones,
// named ".*", left out: the state store's own marker is one), under
// `prefix` ("adapter/"): mode 0644 (files) or 0755 (folders), owner 0, modification time 0,
// so the same folder gives the same bytes. A symbolic link or any other kind of entry is
// refused naming it (an archive never reaches outside the folder), as is a path longer than
// the format holds (ustar: 100 bytes of name plus a 155-byte prefix) or a file of 8 GiB or more.
#ifndef LORASTEP_LIB_IO_TAR_ARCHIVE_H_
#define LORASTEP_LIB_IO_TAR_ARCHIVE_H_

#include <functional>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lorastep {

// The bytes of the archive, in order, to `sink` (its error ends the archive and is
// returned). NOT_FOUND when `folder` is missing; FAILED_PRECONDITION naming an entry it
// cannot archive. The sink may have received part of an archive when an error is returned.
// `extra`: files (name -> contents) added after the folder's, as if they were in it (a marker
// its reader expects, say).
absl::Status WriteTarArchive(const std::string& folder, const std::string& prefix,
                             const std::function<absl::Status(absl::string_view)>& sink,
                             const std::map<std::string, std::string>& extra = {});

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_TAR_ARCHIVE_H_
