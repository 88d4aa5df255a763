// The per-run choices and the staleness record of ddpx/ps.h.
#include <c10/util/Exception.h>
#include <ddpx/ps.h>

#include <algorithm>
#include <cmath>

namespace ddpx::ps {
namespace {

// The whole of `s` must be a non-negative integer.
bool parse_count(const std::string& s, int64_t* out) {
  if (s.empty() || s.size() > 12 || !std::all_of(s.begin(), s.end(), ::isdigit)) return false;
  *out = std::stoll(s);
  return true;
}

}  // namespace

Consistency Consistency::parse(const std::string& spec) {
  const std::string grammar = "; valid: async | ssp:<S> (S >= 0) | sync | sync:<n> (n >= 1)";
  Consistency c;
  if (spec == "async") return c;
  if (spec == "sync") {
    c.kind = Kind::Sync;
    return c;
  }
  if (spec.rfind("ssp:", 0) == 0) {
    c.kind = Kind::Ssp;
    TORCH_CHECK(parse_count(spec.substr(4), &c.bound), "ddpx ps: unknown consistency '", spec, "'",
                grammar);
    return c;
  }
  if (spec.rfind("sync:", 0) == 0) {
    c.kind = Kind::Sync;
    TORCH_CHECK(parse_count(spec.substr(5), &c.quorum) && c.quorum >= 1,
                "ddpx ps: unknown consistency '", spec, "'", grammar);
    return c;
  }
  TORCH_CHECK(false, "ddpx ps: unknown consistency '", spec, "'", grammar);
}

std::string Consistency::str() const {
  switch (kind) {
    case Kind::Async:
      return "async";
    case Kind::Ssp:
      return "ssp:" + std::to_string(bound);
    case Kind::Sync:
      return quorum > 0 ? "sync:" + std::to_string(quorum) : "sync";
  }
  return "?";
}

void Staleness::add(int64_t s, int64_t n) {
  TORCH_INTERNAL_ASSERT(s >= 0);
  if (static_cast<int64_t>(counts.size()) <= s) counts.resize(s + 1, 0);
  counts[s] += n;
}

void Staleness::merge(const Staleness& o) {
  for (size_t s = 0; s < o.counts.size(); ++s) add(static_cast<int64_t>(s), o.counts[s]);
}

int64_t Staleness::total() const {
  int64_t t = 0;
  for (int64_t c : counts) t += c;
  return t;
}

double Staleness::mean() const {
  const int64_t t = total();
  if (t == 0) return 0;
  double sum = 0;
  for (size_t s = 0; s < counts.size(); ++s) sum += double(s) * double(counts[s]);
  return sum / double(t);
}

int64_t Staleness::percentile(double p) const {
  const int64_t t = total();
  if (t == 0) return 0;
  const double need = std::ceil(p * double(t));
  int64_t seen = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    seen += counts[s];
    if (double(seen) >= need) return static_cast<int64_t>(s);
  }
  return max();
}

int64_t Staleness::max() const {
  for (size_t s = counts.size(); s-- > 0;) {
    if (counts[s] > 0) return static_cast<int64_t>(s);
  }
  return 0;
}

}  // namespace ddpx::ps
