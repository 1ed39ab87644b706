// Settings::parse: the module's parameters as modules.json gives them.

#include <string>

#include <gtest/gtest.h>

#include <mesos/mesos.hpp>

#include "settings.hpp"

using gpu_isolator::Settings;

namespace {

mesos::Parameters parameters(
    std::initializer_list<std::pair<std::string, std::string>> pairs)
{
  mesos::Parameters result;
  for (const auto& pair : pairs) {
    mesos::Parameter* parameter = result.add_parameter();
    parameter->set_key(pair.first);
    parameter->set_value(pair.second);
  }
  return result;
}

} // namespace {


TEST(SettingsTest, NoParametersGiveTheDefaults)
{
  Try<Settings> settings = Settings::parse(parameters({}));
  ASSERT_FALSE(settings.isError()) << settings.error();
  EXPECT_EQ("/run/gpu-isolator/isolator.sock", settings->socket);
  EXPECT_TRUE(settings->direct);
  EXPECT_EQ(
      "unix:/run/gpu-isolator/isolator.sock.d/grpc", settings->address());
  EXPECT_EQ(Seconds(60), settings->recover_timeout);
  EXPECT_EQ(Seconds(30), settings->prepare_timeout);
  EXPECT_EQ(Seconds(5), settings->status_timeout);
  EXPECT_EQ(Milliseconds(500), settings->watch_retry_interval);
}


TEST(SettingsTest, EachParameterSetsItsOwnSetting)
{
  Try<Settings> settings = Settings::parse(parameters({
      {"socket", "/tmp/s.sock"},
      {"recover_timeout", "2mins"},
      {"prepare_timeout", "11secs"},
      {"isolate_timeout", "12secs"},
      {"update_timeout", "13secs"},
      {"cleanup_timeout", "14secs"},
      {"usage_timeout", "15secs"},
      {"status_timeout", "16secs"},
      {"watch_retry_interval", "250ms"}}));
  ASSERT_FALSE(settings.isError()) << settings.error();
  EXPECT_EQ("/tmp/s.sock", settings->socket);
  EXPECT_EQ(Minutes(2), settings->recover_timeout);
  EXPECT_EQ(Seconds(11), settings->prepare_timeout);
  EXPECT_EQ(Seconds(12), settings->isolate_timeout);
  EXPECT_EQ(Seconds(13), settings->update_timeout);
  EXPECT_EQ(Seconds(14), settings->cleanup_timeout);
  EXPECT_EQ(Seconds(15), settings->usage_timeout);
  EXPECT_EQ(Seconds(16), settings->status_timeout);
  EXPECT_EQ(Milliseconds(250), settings->watch_retry_interval);
}


TEST(SettingsTest, AnUnknownParameterIsAnError)
{
  Try<Settings> settings =
    Settings::parse(parameters({{"prepare_timout", "1secs"}}));
  ASSERT_TRUE(settings.isError());
  EXPECT_EQ("unknown parameter 'prepare_timout'", settings.error());
}


TEST(SettingsTest, AnEmptySocketIsAnError)
{
  Try<Settings> settings = Settings::parse(parameters({{"socket", ""}}));
  ASSERT_TRUE(settings.isError());
  EXPECT_EQ("parameter 'socket' is empty", settings.error());
}


TEST(SettingsTest, ADurationMustBePositive)
{
  for (const std::string value : {"0secs", "-1secs", "30", "soon", ""}) {
    Try<Settings> settings =
      Settings::parse(parameters({{"usage_timeout", value}}));
    ASSERT_TRUE(settings.isError()) << "'" << value << "' was accepted";
    EXPECT_EQ(
        "parameter 'usage_timeout': '" + value + "' is not a positive"
        " duration (e.g. '30secs', '500ms')",
        settings.error());
  }
}


TEST(SettingsTest, RouteGateCallsThePublicSocketAndDirectTheServersOwn)
{
  Try<Settings> gate = Settings::parse(
      parameters({{"socket", "/tmp/s.sock"}, {"route", "gate"}}));
  ASSERT_FALSE(gate.isError()) << gate.error();
  EXPECT_EQ("unix:/tmp/s.sock", gate->address());

  Try<Settings> direct = Settings::parse(
      parameters({{"socket", "/tmp/s.sock"}, {"route", "direct"}}));
  ASSERT_FALSE(direct.isError()) << direct.error();
  EXPECT_EQ("unix:/tmp/s.sock.d/grpc", direct->address());
}


TEST(SettingsTest, AnUnknownRouteIsAnError)
{
  Try<Settings> settings = Settings::parse(parameters({{"route", "Direct"}}));
  ASSERT_TRUE(settings.isError());
  EXPECT_NE(std::string::npos, settings.error().find("'Direct'"));
}
