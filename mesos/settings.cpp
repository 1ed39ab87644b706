// The module's parameters (see settings.hpp).

#include "settings.hpp"

#include <stout/foreach.hpp>

using std::string;

namespace gpu_isolator {

namespace {

// Where the sidecar's gRPC server itself listens, beside its public socket
// (isolator/transport/peergate.py: PRIVATE_SUFFIX and ALLOWED_NAME; a test
// there keeps them equal).
const char DIRECT_SUFFIX[] = ".d/grpc";

// The setting a duration parameter names, or nullptr.
Duration* durationOf(Settings* settings, const string& key)
{
  if (key == "recover_timeout") return &settings->recover_timeout;
  if (key == "prepare_timeout") return &settings->prepare_timeout;
  if (key == "isolate_timeout") return &settings->isolate_timeout;
  if (key == "update_timeout") return &settings->update_timeout;
  if (key == "cleanup_timeout") return &settings->cleanup_timeout;
  if (key == "usage_timeout") return &settings->usage_timeout;
  if (key == "status_timeout") return &settings->status_timeout;
  if (key == "watch_retry_interval") return &settings->watch_retry_interval;
  return nullptr;
}

} // namespace {


Try<Settings> Settings::parse(const mesos::Parameters& parameters)
{
  Settings settings;
  foreach (const mesos::Parameter& parameter, parameters.parameter()) {
    const string& key = parameter.key();
    const string& value = parameter.value();
    if (key == "socket") {
      if (value.empty()) {
        return Error("parameter 'socket' is empty");
      }
      settings.socket = value;
      continue;
    }
    if (key == "route") {
      if (value != "direct" && value != "gate") {
        return Error(
            "parameter 'route': '" + value + "' is neither 'direct' nor"
            " 'gate'");
      }
      settings.direct = value == "direct";
      continue;
    }
    Duration* target = durationOf(&settings, key);
    if (target == nullptr) {
      return Error("unknown parameter '" + key + "'");
    }
    Try<Duration> duration = Duration::parse(value);
    if (duration.isError() || duration.get() <= Duration::zero()) {
      return Error(
          "parameter '" + key + "': '" + value + "' is not a positive"
          " duration (e.g. '30secs', '500ms')");
    }
    *target = duration.get();
  }
  return settings;
}


string Settings::address() const
{
  return "unix:" + socket + (direct ? DIRECT_SUFFIX : "");
}

} // namespace gpu_isolator {
