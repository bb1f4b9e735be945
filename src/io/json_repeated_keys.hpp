// Repeated JSON keys, found while nlohmann parses.
//
// nlohmann keeps the last of two equal keys in one object without a word,
// and other JSON readers keep the first: a config, profile, safetensors
// header or checkpoint index with a repeated key means different things to
// different programs, so laga refuses them all. One key set per open object
// (a key may recur in different objects); the parse callback feeds every
// event to observe(), which says whether this event is a key already seen
// in its object. Callers add what their message needs (the depth says
// whether the key is a tensor's name or one of its fields; the index also
// remembers shards): configs and profiles use parse_json_refusing_repeated_keys
// (mla/config.hpp), the safetensors header and the sharded index their own
// messages (io/safetensors.cpp, io/safetensors_set.cpp).
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace laga {

class RepeatedKeys {
 public:
  // True at a key event whose key its object already holds; the first such
  // key is kept in first().
  bool observe(nlohmann::json::parse_event_t event, const nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      open_.emplace_back();
    } else if (event == E::object_end) {
      if (!open_.empty()) open_.pop_back();
    } else if (event == E::key && !open_.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!open_.back().insert(key).second) {
        if (first_.empty()) first_ = key;
        return true;
      }
    }
    return false;
  }
  const std::string& first() const { return first_; }  // empty: none repeated

 private:
  std::vector<std::set<std::string>> open_;  // the keys of each open object
  std::string first_;
};

}  // namespace laga
