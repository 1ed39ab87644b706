// resources_parse.cpp: Mesos's own parser of the agent's --resources flag (mesos::Resources::parse from
// libmesos: the text form split by Resources::fromSimpleString, then Resources::validate on each, as the
// agent does on start) applied to the string gpu-isolator prints.
// tests/mesos/test_resources_parse.py compiles it at test time; nothing here is shipped.
//
//   resources_parse STRING   prints one JSON object per resource, as stout's JSON::protobuf writes a
//                            mesos::Resource ({"name", "type", "scalar", "role"...}), and exits 0; a
//                            string Mesos refuses prints its error on stderr and exits 1.

#include <iostream>
#include <string>

#include <mesos/mesos.pb.h>
#include <mesos/resources.hpp>

#include <stout/json.hpp>
#include <stout/protobuf.hpp>
#include <stout/stringify.hpp>

int main(int argc, char** argv)
{
  if (argc != 2) {
    std::cerr << "usage: resources_parse STRING" << std::endl;
    return 2;
  }
  Try<mesos::Resources> resources = mesos::Resources::parse(argv[1]);
  if (resources.isError()) {
    std::cerr << resources.error() << std::endl;
    return 1;
  }
  for (const mesos::Resource& resource : resources.get()) {
    Option<Error> error = mesos::Resources::validate(resource);
    if (error.isSome()) {
      std::cerr << error->message << std::endl;
      return 1;
    }
    std::cout << stringify(JSON::protobuf(resource)) << std::endl;
  }
  return 0;
}
