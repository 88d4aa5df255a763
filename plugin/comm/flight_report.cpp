#include "plugin/comm/flight_report.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "plugin/comm/peer_report.h"

namespace ddpx::comm::detail {
namespace {

std::string sizes_text(const std::vector<std::vector<int64_t>>& sizes) {
  std::string s;
  for (size_t i = 0; i < sizes.size(); ++i) {
    s += i ? "," : "";
    s += "[";
    for (size_t d = 0; d < sizes[i].size(); ++d) s += (d ? "," : "") + std::to_string(sizes[i][d]);
    s += "]";
  }
  return s.empty() ? "[]" : s;
}

std::string ranks_text(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

// What must be equal on every rank for one collective.
struct Signature {
  FrOp op;
  std::vector<std::vector<int64_t>> sizes;
  std::vector<c10::ScalarType> dtypes;
  int64_t step;
  int bucket;
  bool operator<(const Signature& o) const {
    return std::tie(op, sizes, dtypes, step, bucket) <
           std::tie(o.op, o.sizes, o.dtypes, o.step, o.bucket);
  }
  bool operator==(const Signature& o) const { return !(*this < o) && !(o < *this); }
};

Signature signature(const FrRecord& r) {
  return {r.op, r.input_sizes, r.input_dtypes, r.step, r.bucket};
}

// One group as each rank recorded it.
struct GroupView {
  std::string name;
  std::string lib;
  std::vector<int64_t> ranks;
  std::map<int, std::map<uint64_t, const FrRecord*>> by_rank;  // rank -> seq -> record
  std::map<int, const FrSnapshot*> snaps;
};

std::string group_title(const GroupView& g) {
  std::vector<int> ranks(g.ranks.begin(), g.ranks.end());
  return "group \"" + g.name + "\" (" + (g.lib == "gradsync" ? "GradSync" : g.lib) + ", " +
         std::to_string(ranks.size()) + (ranks.size() == 1 ? " rank" : " ranks") + ")";
}

}  // namespace

std::string fr_describe(const FrRecord& r, const FrSnapshot& snap) {
  std::ostringstream s;
  s << fr_op_name(r.op);
  if (r.p2p) s << (r.op == FrOp::kSend ? " to " : " from ") << r.peer;
  if (!r.input_sizes.empty()) {
    s << " " << r.input_sizes.size() << "x" << sizes_text(r.input_sizes);
    if (!r.input_dtypes.empty()) s << " " << c10::toString(r.input_dtypes[0]);
  }
  if (r.step >= 0) {
    s << " (step " << r.step;
    if (r.bucket >= 0) s << ", bucket " << r.bucket;
    if (r.names >= 0 && r.names < static_cast<int>(snap.names.size())) {
      const auto& n = snap.names[r.names];
      s << ": ";
      for (size_t i = 0; i < n.size() && i < 3; ++i) s << (i ? ", " : "") << n[i];
      if (n.size() > 3) s << ", ... (" << n.size() << " tensors)";
    }
    s << ")";
  }
  return s.str();
}

FrReport fr_analyze(const std::map<int, FrSnapshot>& by_rank, const std::vector<int>& expected) {
  FrReport report;
  // Groups by (lib, name), in first-seen order.
  std::vector<GroupView> groups;
  std::set<int> named;  // every rank some group names
  for (const auto& [rank, snap] : by_rank) {
    for (const auto& rec : snap.records) {
      if (rec.p2p || rec.group < 0 || rec.group >= static_cast<int>(snap.groups.size())) continue;
      if (rec.collective_seq == 0) continue;  // posted, not yet in its group's order (post_order.h)
      const FrGroup& g = snap.groups[rec.group];
      auto it = std::find_if(groups.begin(), groups.end(), [&](const GroupView& v) {
        return v.name == g.name && v.lib == g.lib && v.ranks == g.ranks;
      });
      if (it == groups.end()) {
        groups.push_back({g.name, g.lib, g.ranks, {}, {}});
        it = groups.end() - 1;
        for (int64_t r : g.ranks) named.insert(static_cast<int>(r));
      }
      it->by_rank[rank][rec.collective_seq] = &rec;
      it->snaps[rank] = &snap;
    }
  }
  std::vector<int> all = expected;
  if (all.empty()) all.assign(named.begin(), named.end());
  std::vector<int> answered, silent;
  for (int r : all) (by_rank.count(r) ? answered : silent).push_back(r);

  std::ostringstream screen;
  screen << "ddpx flight recorder: " << ranks_text(answered) << " answered";
  if (!silent.empty()) {
    screen << "; " << ranks_text(silent)
           << " did not (stopped, dead, or stuck where it cannot answer)";
    report.findings.push_back({FrFinding::Kind::kNoAnswer, "", 0, silent,
                               ranks_text(silent) + " did not answer: stopped, dead, or stuck "
                                                    "where it cannot answer"});
  }
  screen << "\n";

  std::vector<FrFinding> mismatches, behind;
  std::vector<std::string> quiet;  // groups where every rank is done and at the same call
  for (const auto& g : groups) {
    std::ostringstream lines;
    uint64_t window_lo = 0, top = 0;
    for (const auto& [rank, recs] : g.by_rank) {
      window_lo = std::max(window_lo, recs.begin()->first);  // older ones wrapped away somewhere
      top = std::max(top, recs.rbegin()->first);
    }
    for (const auto& [rank, recs] : g.by_rank) {
      const FrSnapshot& snap = *g.snaps.at(rank);
      const FrRecord* done = nullptr;
      const FrRecord* pending = nullptr;
      for (const auto& [seq, rec] : recs) {
        if (rec->finished_ns != 0 && !rec->failed) {
          done = rec;
        } else if (pending == nullptr) {
          pending = rec;  // the first call not done (failed: timed out, or refused)
        }
      }
      lines << "  rank " << rank << ": ";
      if (done != nullptr) {
        lines << "done #" << done->collective_seq << " " << fr_describe(*done, snap);
      } else {
        lines << "nothing done";
      }
      if (pending != nullptr) {
        lines << "; "
              << (pending->failed       ? "failed"
                  : pending->started_ns ? "in"
                                        : "queued")
              << " #" << pending->collective_seq << " " << fr_describe(*pending, snap);
      } else {
        lines << "; nothing pending";
      }
      lines << "\n";
    }
    // The first sequence number the ranks disagree on.
    uint64_t common_top = top;
    for (const auto& [rank, recs] : g.by_rank)
      common_top = std::min(common_top, recs.rbegin()->first);
    bool found = false;
    for (uint64_t s = window_lo; s <= common_top && !found; ++s) {
      std::map<Signature, std::vector<int>> kinds;
      std::map<Signature, const FrRecord*> example;
      for (const auto& [rank, recs] : g.by_rank) {
        auto it = recs.find(s);
        if (it == recs.end()) continue;
        const Signature sig = signature(*it->second);
        kinds[sig].push_back(rank);
        example[sig] = it->second;
      }
      if (kinds.size() < 2) continue;
      found = true;
      // The most common call is taken as the intended one; ties go to the
      // call of the lowest rank.
      auto majority =
          std::max_element(kinds.begin(), kinds.end(), [](const auto& a, const auto& b) {
            return a.second.size() != b.second.size() ? a.second.size() < b.second.size()
                                                      : a.second.front() > b.second.front();
          });
      std::vector<int> culprits;
      std::string parts;
      for (const auto& [sig, ranks] : kinds) {
        const FrRecord* ex = example[sig];
        parts += (parts.empty() ? "" : "; ") + ranks_text(ranks) + " " +
                 fr_describe(*ex, *g.snaps.at(ranks.front()));
        if (sig == majority->first) continue;
        culprits.insert(culprits.end(), ranks.begin(), ranks.end());
      }
      std::sort(culprits.begin(), culprits.end());
      mismatches.push_back(
          {FrFinding::Kind::kMismatch, g.name, s, culprits,
           "first disagreement in " + group_title(g) + " at #" + std::to_string(s) + ": " + parts});
    }
    // Ranks that never reached the last collective the others are in.
    std::vector<int> late;
    for (const auto& [rank, recs] : g.by_rank) {
      if (recs.rbegin()->first < top) late.push_back(rank);
    }
    if (!late.empty()) {
      std::vector<int> at_top;
      for (const auto& [rank, recs] : g.by_rank) {
        if (recs.rbegin()->first == top) at_top.push_back(rank);
      }
      const auto& lead = g.by_rank.at(at_top.front());
      std::string text = ranks_text(at_top) + " reached #" + std::to_string(top) + " " +
                         fr_describe(*lead.at(top), *g.snaps.at(at_top.front())) + " in " +
                         group_title(g);
      for (int r : late) {
        const auto& recs = g.by_rank.at(r);
        const FrRecord* last = recs.rbegin()->second;
        text += "; rank " + std::to_string(r) + " is " +
                std::to_string(top - last->collective_seq) +
                (top - last->collective_seq == 1 ? " collective" : " collectives") +
                " behind, last seen at #" + std::to_string(last->collective_seq) + " " +
                fr_describe(*last, *g.snaps.at(r)) +
                (last->failed        ? " (failed)"
                 : last->finished_ns ? " (done)"
                                     : " (not done)");
      }
      behind.push_back({FrFinding::Kind::kBehind, g.name, top, late, text});
    }
    bool all_done = found || !late.empty() ? false : true;
    for (const auto& [rank, recs] : g.by_rank) {
      const FrRecord* last = recs.rbegin()->second;
      all_done = all_done && last->finished_ns != 0 && !last->failed;
    }
    if (all_done) {
      quiet.push_back("\"" + g.name + "\"");
    } else {
      screen << group_title(g) << ":\n" << lines.str();
    }
  }
  if (!quiet.empty()) {
    screen << (quiet.size() == 1 ? "group " : "groups ") << c10::Join(", ", quiet)
           << ": every rank done, at the same call\n";
  }
  // Most telling first: a disagreement names the call that went wrong; a rank
  // behind names where it stopped; no answer names only who.
  std::vector<FrFinding> ordered;
  ordered.insert(ordered.end(), mismatches.begin(), mismatches.end());
  ordered.insert(ordered.end(), behind.begin(), behind.end());
  ordered.insert(ordered.end(), report.findings.begin(), report.findings.end());
  report.findings = std::move(ordered);
  screen << "diagnosis:\n";
  if (report.findings.empty()) {
    screen << "  every rank that answered recorded the same calls and reached the same one: "
              "the transfer itself stalled, or the job is healthy\n";
  }
  for (const auto& f : report.findings) screen << "  - " << f.text << "\n";
  report.text = screen.str();
  return report;
}

}  // namespace ddpx::comm::detail
