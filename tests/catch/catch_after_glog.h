// Catch2 for a test that includes LibTorch headers bringing glog's CHECK (c10d,
// the qk-clip what-if): glog's aborts the process on failure, Catch's reports
// and goes on. No include guard on purpose: in a unity batch Catch's header is
// already in, so only redefining the macro here makes the file after use Catch's.
#include <catch2/catch.hpp>
#undef CHECK
#define CHECK(...) INTERNAL_CATCH_TEST("CHECK", Catch::ResultDisposition::ContinueOnFailure, __VA_ARGS__)
