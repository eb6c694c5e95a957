// Catch2's implementation, compiled once for every test executable.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "tests/catch/catch_session.h"

namespace nanreplay_test {
int run_catch_session(int argc, char** argv) { return Catch::Session().run(argc, argv); }
}  // namespace nanreplay_test
