// ddpx_mpi member ids ("job:world_rank") come from other processes (merge's
// store, reconfigure's handles): whatever arrives is an id of this job or a
// c10::Error naming it. ("job:x" and "job:99999999999" used to escape as
// std::invalid_argument / std::out_of_range, and "job:1x" parsed as rank 1.)
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "plugin/comm/member_id.h"

namespace {

using ddpx::comm::detail::parse_member_id;

TEST(MemberId, ParsesItsOwnJob) {
  EXPECT_EQ(parse_member_id("42@1:0", "42@1", 4, "merge()"), 0);
  EXPECT_EQ(parse_member_id("42@1:3", "42@1", 4, "merge()"), 3);
  // A job name may itself hold colons: the rank is after the last one.
  EXPECT_EQ(parse_member_id("a:b:2", "a:b", 3, "merge()"), 2);
}

TEST(MemberId, RefusesAnotherJob) {
  EXPECT_THROW(parse_member_id("43@1:0", "42@1", 4, "merge()"), c10::Error);
  EXPECT_THROW(parse_member_id("42@:0", "42@1", 4, "merge()"), c10::Error);
  EXPECT_THROW(parse_member_id("42@10:0", "42@1", 4, "merge()"), c10::Error);
}

// Each of these once escaped as a standard-library exception (or parsed a
// prefix): the message must name the id.
TEST(MemberId, RefusesMalformedRanks) {
  for (const std::string id : {"42@1:x", "42@1:1x", "42@1: 1", "42@1:-1", "42@1:+1",
                               "42@1:99999999999", "42@1:", "42@1", ""}) {
    try {
      parse_member_id(id, "42@1", 4, "reconfigure()");
      ADD_FAILURE() << "'" << id << "' parsed";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("reconfigure()"), std::string::npos)
          << e.what_without_backtrace();
    }
  }
}

TEST(MemberId, RefusesRanksOutsideTheWorld) {
  EXPECT_THROW(parse_member_id("42@1:4", "42@1", 4, "merge()"), c10::Error);
}

}  // namespace
