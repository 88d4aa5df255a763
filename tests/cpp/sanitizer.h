#pragma once
// Whether this test binary is built with ThreadSanitizer (build-tsan): a few
// tests measure something the instrumentation changes, or provoke a race on
// purpose, and skip there.
namespace ddpx::test {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
#else
inline constexpr bool kThreadSanitizer = false;
#endif

}  // namespace ddpx::test
