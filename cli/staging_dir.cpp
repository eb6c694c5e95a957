#include "cli/staging_dir.h"

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "loaders/base/error.h"

namespace nanreplay {

namespace fs = std::filesystem;

StagingDir::StagingDir(const fs::path& out, const char* purpose) {
  const fs::path parent = fs::absolute(out).parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  std::string pattern = (parent / ("." + out.filename().string() + "." + purpose + "-XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) {
    throw OutputError(out.string(), std::string("cannot create a staging directory beside it: ") + std::strerror(errno));
  }
  dir_ = pattern;
}

StagingDir::~StagingDir() {
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

}  // namespace nanreplay
