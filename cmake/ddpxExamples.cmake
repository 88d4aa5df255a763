# The examples in our public headers and the README are compiled and run by
# tests, as they stand: in a header, the comment lines between
# "// [example NAME]" and "// [end example]", less their leading "//"; in
# the README, the fenced code block between "<!-- [example NAME] -->" and
# "<!-- [end example] -->" lines, less the fence lines.
#
# ddpx_header_example(NAME HEADER), ddpx_readme_example(NAME FILE): write
# example NAME to ${CMAKE_BINARY_DIR}/examples/NAME.inc at configure time
# (CMake re-runs when the file changes, and the .inc is rewritten only when
# the text did), for a test to #include where the example's context is set
# up.

# The text of `file` between `begin_mark` and `end_mark`, each line's
# `strip` (a regex anchored at a line's start) removed, written as NAME.inc.
function(_ddpx_write_example name file begin_mark end_mark strip)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${file})
  file(READ ${file} text)
  string(FIND "${text}" "${begin_mark}\n" begin)
  if(begin EQUAL -1)
    message(FATAL_ERROR "${file} has no '${begin_mark}'")
  endif()
  string(LENGTH "${begin_mark}\n" mark_length)
  math(EXPR begin "${begin} + ${mark_length}")
  string(SUBSTRING "${text}" ${begin} -1 rest)
  string(FIND "${rest}" "${end_mark}" end)
  if(end EQUAL -1)
    message(FATAL_ERROR "${file}: example ${name} has no '${end_mark}'")
  endif()
  string(SUBSTRING "${rest}" 0 ${end} code)
  string(REGEX REPLACE "(^|\n)${strip}" "\\1" code "${code}")
  set(out ${CMAKE_BINARY_DIR}/examples/${name}.inc)
  file(WRITE ${out}.tmp "// Example ${name} of ${file}, as it stands there.\n${code}")
  file(COPY_FILE ${out}.tmp ${out} ONLY_IF_DIFFERENT)
  file(REMOVE ${out}.tmp)
endfunction()

function(ddpx_header_example name header)
  _ddpx_write_example(${name} ${header} "// [example ${name}]" "// [end example]" "//")
endfunction()

function(ddpx_readme_example name file)
  _ddpx_write_example(${name} ${file} "<!-- [example ${name}] -->" "<!-- [end example] -->"
                      "```[a-z]*\n")
endfunction()
