// The CPU suite's main: Catch2 as usual.
#include "tests/catch/catch_session.h"

int main(int argc, char** argv) { return nanreplay_test::run_catch_session(argc, argv); }
