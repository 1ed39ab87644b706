// The module's decisions about time: retries, deadlines, watches and the
// operator's message.

#include <chrono>
#include <string>

#include <gtest/gtest.h>

#include <stout/gtest.hpp>

#include "retry.hpp"

using gpu_isolator::cleanupWait;
using gpu_isolator::CleanupWait;
using gpu_isolator::deadlineMs;
using gpu_isolator::describe;
using gpu_isolator::parsePushback;
using gpu_isolator::retryAfter;
using gpu_isolator::UNAVAILABLE_RETRY;
using gpu_isolator::watchNext;
using gpu_isolator::WatchNext;

using Clock = std::chrono::system_clock;

namespace {

const Clock::time_point NOW = Clock::time_point(std::chrono::hours(1000));
const Clock::time_point IN_1S = NOW + std::chrono::seconds(1);

} // namespace {


TEST(RetryTest, ALoadShedRefusalIsRetriedAfterItsPushback)
{
  Option<Duration> wait =
    retryAfter(grpc::RESOURCE_EXHAUSTED, 20, NOW, IN_1S);
  ASSERT_SOME(wait);
  EXPECT_EQ(Milliseconds(20), wait.get());
}


TEST(RetryTest, ARefusalWithoutPushbackIsFinal)
{
  // "no free GPU": asking again cannot help.
  EXPECT_NONE(retryAfter(grpc::RESOURCE_EXHAUSTED, None(), NOW, IN_1S));
}


TEST(RetryTest, AnUnavailableSidecarIsRetriedSoon)
{
  Option<Duration> wait = retryAfter(grpc::UNAVAILABLE, None(), NOW, IN_1S);
  ASSERT_SOME(wait);
  EXPECT_EQ(UNAVAILABLE_RETRY, wait.get());
}


TEST(RetryTest, NoRetryEndsAfterTheDeadline)
{
  EXPECT_NONE(retryAfter(grpc::RESOURCE_EXHAUSTED, 1000, NOW, IN_1S));
  EXPECT_NONE(retryAfter(
      grpc::UNAVAILABLE,
      None(),
      NOW,
      NOW + std::chrono::milliseconds(100)));
  EXPECT_SOME(retryAfter(grpc::RESOURCE_EXHAUSTED, 999, NOW, IN_1S));
}


TEST(RetryTest, OtherCodesAreTheAnswer)
{
  for (grpc::StatusCode code :
       {grpc::NOT_FOUND, grpc::INVALID_ARGUMENT, grpc::DEADLINE_EXCEEDED,
        grpc::INTERNAL, grpc::FAILED_PRECONDITION}) {
    EXPECT_NONE(retryAfter(code, 20, NOW, IN_1S)) << code;
  }
}


TEST(RetryTest, APushbackIsANonNegativeNumber)
{
  EXPECT_SOME_EQ(20, parsePushback("20"));
  EXPECT_SOME_EQ(0, parsePushback("0"));
  for (const std::string text : {"", "-1", "20ms", " 20", "x"}) {
    EXPECT_NONE(parsePushback(text)) << "'" << text << "'";
  }
}


TEST(RetryTest, TheDeadlineIsSentOnTheMonotonicClock)
{
  const std::chrono::steady_clock::time_point steady(
      std::chrono::milliseconds(5000));
  EXPECT_EQ(6000, deadlineMs(IN_1S, NOW, steady));
  EXPECT_EQ(4000, deadlineMs(NOW - std::chrono::seconds(1), NOW, steady));
}


TEST(RetryTest, OnlyALimitationEndsAWatch)
{
  EXPECT_EQ(WatchNext::LIMITED, watchNext(true, grpc::OK, true));
  EXPECT_EQ(WatchNext::WATCH_NOW, watchNext(true, grpc::OK, false));
  EXPECT_EQ(WatchNext::STOP, watchNext(true, grpc::NOT_FOUND, false));
  EXPECT_EQ(WatchNext::WATCH_LATER, watchNext(true, grpc::UNAVAILABLE, false));
  EXPECT_EQ(
      WatchNext::WATCH_LATER, watchNext(true, grpc::RESOURCE_EXHAUSTED, false));
  EXPECT_EQ(WatchNext::WATCH_LATER, watchNext(false, grpc::UNKNOWN, false));
}


TEST(RetryTest, ACleanupWaitsAsLongAsTheSidecarMayHoldTheContainer)
{
  // Prepared, or refused by a sidecar that answered: its whole deadline.
  EXPECT_EQ(CleanupWait::FULL, cleanupWait(false, true, true));
  EXPECT_EQ(CleanupWait::FULL, cleanupWait(false, false, true));
  EXPECT_EQ(CleanupWait::FULL, cleanupWait(true, true, true));
  // The sidecar is back by the Cleanup: it answers, whatever it saw.
  EXPECT_EQ(CleanupWait::FULL, cleanupWait(true, true, false));
  // Failed unreachable after a connection: it may have served the Prepare.
  EXPECT_EQ(CleanupWait::BRIEF, cleanupWait(true, false, true));
  // Never connected while the Prepare was tried: it never saw it.
  EXPECT_EQ(CleanupWait::NONE, cleanupWait(true, false, false));
}


TEST(RetryTest, ASidecarsRefusalIsPassedOnInItsOwnWords)
{
  EXPECT_EQ(
      "gpu-isolator Prepare: RESOURCE_EXHAUSTED: no free GPU",
      describe(
          "Prepare",
          grpc::RESOURCE_EXHAUSTED,
          "no free GPU",
          "/s.sock",
          Seconds(30),
          None()));
}


TEST(RetryTest, NoAnswerSaysWhereAndHowLong)
{
  EXPECT_EQ(
      "gpu-isolator Prepare: DEADLINE_EXCEEDED: no answer from the sidecar"
      " at '/s.sock' within 30secs (it is unreachable: is 'gpu-isolator"
      " serve' running?)",
      describe(
          "Prepare",
          grpc::DEADLINE_EXCEEDED,
          "Deadline Exceeded",
          "/s.sock",
          Seconds(30),
          std::string("unreachable")));
  EXPECT_EQ(
      "gpu-isolator Cleanup: UNAVAILABLE: no answer from the sidecar at"
      " '/s.sock' within 5secs",
      describe(
          "Cleanup", grpc::UNAVAILABLE, "", "/s.sock", Seconds(5), None()));
}
