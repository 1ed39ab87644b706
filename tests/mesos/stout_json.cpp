// stout_json.cpp: Mesos's own JSON code (stout's JSON::protobuf and protobuf::parse, from
// MESOS_HOME/include, with the message classes of libmesos) applied to gpu-isolator's bytes.
// tests/mesos/test_stout_json.py compiles it at test time; nothing here is shipped.
//
//   stout_json input    stdin: hook inputs {"container_id", "container_config"?, "pid"?}, one per
//                       line, as our fixtures (isolator/testing/mesos_json.py) spell them; one
//                       answer line per input line (libmesos takes a while to load). Parsed into Mesos's
//                       ContainerID and ContainerConfig and written again the way criteo's module
//                       composes a hook's input: a JSON::Object of JSON::protobuf(...) values.
//   stout_json output M stdin: what a bridge executable wrote to OUT for method M (prepare, watch,
//                       usage). Read the way the module reads it: JSON::parse, an object expected,
//                       protobuf::parse<ContainerLaunchInfo | ContainerLimitation | ResourceStatistics>;
//                       the message is written back with JSON::protobuf so that a caller sees what
//                       the agent got.
//
// Prints "OK <json>" and exits 0, or "ERROR <stout's message>" and exits 1.

#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

#include <mesos/mesos.pb.h>
#include <mesos/slave/containerizer.pb.h>

#include <stout/json.hpp>
#include <stout/protobuf.hpp>
#include <stout/stringify.hpp>
#include <stout/try.hpp>

namespace {

int fail(const std::string& message)
{
  std::cout << "ERROR " << message << std::endl;
  return 1;
}

template <typename T>
int readOutput(const std::string& text)
{
  Try<JSON::Value> value = JSON::parse(text);
  if (value.isError()) {
    return fail("Malformed JSON. " + value.error());
  }
  if (!value->is<JSON::Object>()) {
    return fail("Malformed Protobuf. JSON object is expected.");
  }
  Try<T> message = ::protobuf::parse<T>(value.get());
  if (message.isError()) {
    return fail("Error while converting JSON to protobuf. " + message.error());
  }
  std::cout << "OK " << stringify(JSON::protobuf(message.get())) << std::endl;
  return 0;
}

int writeInput(const std::string& text)
{
  Try<JSON::Object> object = JSON::parse<JSON::Object>(text);
  if (object.isError()) {
    return fail("input: " + object.error());
  }
  JSON::Object out;
  for (const auto& entry : object->values) {
    const std::string& key = entry.first;
    if (key == "container_id") {
      Try<mesos::ContainerID> id = ::protobuf::parse<mesos::ContainerID>(entry.second);
      if (id.isError()) {
        return fail("container_id: " + id.error());
      }
      out.values[key] = JSON::protobuf(id.get());
    } else if (key == "container_config") {
      Try<mesos::slave::ContainerConfig> config =
        ::protobuf::parse<mesos::slave::ContainerConfig>(entry.second);
      if (config.isError()) {
        return fail("container_config: " + config.error());
      }
      out.values[key] = JSON::protobuf(config.get());
    } else if (key == "pid") {
      if (!entry.second.is<JSON::Number>()) {
        return fail("pid: not a number");
      }
      // The module assigns a pid_t.
      pid_t pid = static_cast<pid_t>(entry.second.as<JSON::Number>().as<int64_t>());
      out.values[key] = pid;
    } else {
      return fail("the module writes no key '" + key + "'");
    }
  }
  std::cout << "OK " << stringify(out) << std::endl;
  return 0;
}

} // namespace

int main(int argc, char** argv)
{
  GOOGLE_PROTOBUF_VERIFY_VERSION;
  std::string text(std::istreambuf_iterator<char>(std::cin), {});
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "input" && argc == 2) {
    std::istringstream lines(text);
    std::string line;
    int status = 0;
    while (std::getline(lines, line)) {
      status |= writeInput(line);
    }
    return status;
  }
  if (mode == "output" && argc == 3) {
    std::string method = argv[2];
    if (method == "prepare") {
      return readOutput<mesos::slave::ContainerLaunchInfo>(text);
    }
    if (method == "watch") {
      return readOutput<mesos::slave::ContainerLimitation>(text);
    }
    if (method == "usage") {
      return readOutput<mesos::ResourceStatistics>(text);
    }
  }
  std::cerr << "usage: stout_json input | stout_json output prepare|watch|usage" << std::endl;
  return 2;
}
