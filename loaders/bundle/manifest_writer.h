// A Manifest written back as manifest.json: the reader's own schema
// (loaders/bundle/manifest.h) turned around, so a bundle this project writes
// (synthetic bundles, minimized ones) says exactly what parse_manifest reads.
// parse_manifest(manifest_json(m).dump()) gives `m` back.
#pragma once

#include <nlohmann/json.hpp>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

nlohmann::json manifest_json(const Manifest& manifest);

}  // namespace nanreplay
