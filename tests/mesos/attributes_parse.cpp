// attributes_parse.cpp: Mesos's own parser of the agent's --attributes flag (mesos::Attributes::parse
// from libmesos, as the agent calls it on start) applied to the string gpu-isolator prints.
// tests/mesos/test_attributes_parse.py compiles it at test time; nothing here is shipped.
//
//   attributes_parse STRING   prints one JSON object per attribute, as stout's JSON::protobuf writes a
//                             mesos::Attribute ({"name", "type", "scalar"|"text"|"ranges"}), and exits 0.
//                             A value Mesos refuses aborts the process (Mesos's LOG(FATAL)), as it
//                             would abort the agent.

#include <iostream>
#include <string>

#include <mesos/attributes.hpp>
#include <mesos/mesos.pb.h>

#include <stout/json.hpp>
#include <stout/protobuf.hpp>
#include <stout/stringify.hpp>

int main(int argc, char** argv)
{
  if (argc != 2) {
    std::cerr << "usage: attributes_parse STRING" << std::endl;
    return 2;
  }
  const mesos::Attributes attributes = mesos::Attributes::parse(argv[1]);
  for (const mesos::Attribute& attribute : attributes) {
    std::cout << stringify(JSON::protobuf(attribute)) << std::endl;
  }
  return 0;
}
