// Runs Catch2 over the test cases linked into this executable. Catch2's
// implementation (catch_session.cpp) is compiled once and shared by the CPU
// suite and the GPU tests, whose mains differ.
#pragma once

namespace nanreplay_test {
int run_catch_session(int argc, char** argv);
}  // namespace nanreplay_test
