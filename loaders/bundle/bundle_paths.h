// Resolving paths named inside a bundle. A path must be relative, contain no
// "..", and (after following symlinks) stay inside the bundle root.
#pragma once

#include <filesystem>
#include <string>

namespace nanreplay {

// Syntax only, no filesystem access (the manifest checks paths this way):
// throws InputError(file_label, key, ...) when `relative` is empty, absolute,
// has a ".." component or holds a NUL or other control character.
void check_bundle_relative_path(const std::string& relative, const std::string& file_label,
                                const std::string& key);

// Returns the absolute resolved path of `relative` inside `bundle_root`.
// Throws InputError(file_label, key, ...) when it is absolute, contains "..",
// is empty, or resolves (through symlinks) outside the bundle root.
// Existence is not checked here.
std::filesystem::path resolve_in_bundle(const std::filesystem::path& bundle_root,
                                        const std::string& relative,
                                        const std::string& file_label,
                                        const std::string& key);

// The absolute path `path` names once its missing directories are created:
// the part that exists resolved by the kernel (symlinks followed), the rest
// normalised (a ".." after a directory still to be created goes back to its
// parent), repeated until stable, so "new/../link-into-bundle/x" resolves
// into the bundle. Creating the result component by component creates
// exactly what was checked.
std::filesystem::path resolve_for_creation(const std::filesystem::path& path);

// Whether `path` is, or once created would lie inside, `directory`. Compares
// device and inode, not text: the nearest existing ancestor of
// resolve_for_creation(path), then each of its parents, against `directory`,
// so a relative path that does not exist yet, "..", symlinks and bind mounts
// of `directory` are all seen through. False when `directory` does not exist.
bool lies_inside_directory(const std::filesystem::path& path, const std::filesystem::path& directory);

}  // namespace nanreplay
