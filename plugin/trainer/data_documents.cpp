// The generated document set for token models (HAN): see data.h for the rule
// that ties a document's label to its sentences.
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "plugin/trainer/data.h"

namespace ddpx::trainer {
namespace {

// Token ids: 0 = padding, then `topic_words` ids per topic, then filler words.
struct Vocab {
  int64_t topic_words, first_filler, size;
  int64_t topic_word(int topic, int64_t k) const { return 1 + topic * topic_words + k; }
};

Dataset generate(const DocSpec& s, const Vocab& v, int64_t n, std::mt19937_64& rng) {
  Dataset ds;
  ds.inputs = at::zeros({n, s.sentences, s.words}, at::kLong);
  ds.targets = at::empty({n}, at::kLong);
  auto tok = ds.inputs.accessor<int64_t, 3>();
  auto lab = ds.targets.accessor<int64_t, 1>();
  const int S = static_cast<int>(s.sentences), W = static_cast<int>(s.words);
  const int C = static_cast<int>(s.classes);
  std::uniform_int_distribution<int64_t> topic_k(0, v.topic_words - 1);
  std::uniform_int_distribution<int64_t> filler(v.first_filler, v.size - 1);
  std::uniform_int_distribution<int> cls(0, C - 1), len(std::min(5, W), W);
  for (int64_t d = 0; d < n; ++d) {
    // Sentence topics: the label's topic holds a strict plurality of sentences.
    const int label = cls(rng);
    // The label's topic gets `majority` sentences and every other topic
    // fewer, so the rest must fit in (C - 1) x (majority - 1): raise it until
    // they do (with 6 sentences and 4 topics, 2 did not, and the draw below
    // never ended).
    int majority = S / C + 1 + static_cast<int>(rng() % 2);
    while (S - majority > (C - 1) * (majority - 1)) ++majority;
    std::vector<int> topics(S);
    std::vector<int> count(C, 0);
    for (int i = 0; i < S; ++i) {
      int t = label;
      if (i >= majority) {
        do t = cls(rng); while (t == label || count[t] + 1 >= majority);
      }
      topics[i] = t;
      ++count[t];
    }
    std::shuffle(topics.begin(), topics.end(), rng);
    for (int i = 0; i < S; ++i) {
      const int n_words = len(rng);
      // Minority sentences are wordier about their topic than majority ones.
      const int n_topic = topics[i] == label ? 1 + static_cast<int>(rng() % 2)
                                             : 2 + static_cast<int>(rng() % 3);
      std::vector<int64_t> words(n_words);
      for (int w = 0; w < n_words; ++w) {
        words[w] = w < n_topic ? v.topic_word(topics[i], topic_k(rng)) : filler(rng);
      }
      std::shuffle(words.begin(), words.end(), rng);
      for (int w = 0; w < n_words; ++w) tok[d][i][w] = words[w];
    }
    lab[d] = label;
  }
  return ds;
}

}  // namespace

DataSplit make_documents(const DocSpec& s, int64_t n_train, int64_t n_test, uint64_t seed) {
  TORCH_CHECK(s.classes >= 2 && s.sentences >= 2 && s.words >= 1,
              "ddpx-train: a token model needs >= 2 classes and sentences, got ", s.classes,
              " classes, ", s.sentences, " sentences");
  TORCH_CHECK(s.sentences >= s.classes / 2 + 2, "ddpx-train: ", s.sentences,
              " sentences are too few to give one of ", s.classes, " topics a plurality");
  Vocab v;
  v.topic_words = std::min<int64_t>(50, (s.vocab - 1) / (2 * s.classes));
  TORCH_CHECK(v.topic_words >= 4, "ddpx-train: vocabulary of ", s.vocab,
              " is too small for ", s.classes, " topics");
  v.first_filler = 1 + s.classes * v.topic_words;
  v.size = s.vocab;
  std::mt19937_64 rng(seed);
  DataSplit out;
  out.num_classes = s.classes;
  out.train = generate(s, v, n_train, rng);
  out.test = generate(s, v, n_test, rng);
  return out;
}

}  // namespace ddpx::trainer
