# The examples in our public headers are compiled and run by tests, as they
# stand: in a header, the comment lines between "// [example NAME]" and
# "// [end example]", less their leading "//", are example NAME.
#
# ddpx_header_example(NAME HEADER): writes example NAME of HEADER to
# ${CMAKE_BINARY_DIR}/examples/NAME.inc at configure time (CMake re-runs when
# the header changes, and the file is rewritten only when the text did), for
# a test to #include where the example's context is set up.
function(ddpx_header_example name header)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${header})
  file(READ ${header} text)
  set(begin_mark "// [example ${name}]\n")
  string(FIND "${text}" "${begin_mark}" begin)
  if(begin EQUAL -1)
    message(FATAL_ERROR "${header} has no '// [example ${name}]'")
  endif()
  string(LENGTH "${begin_mark}" mark_length)
  math(EXPR begin "${begin} + ${mark_length}")
  string(SUBSTRING "${text}" ${begin} -1 rest)
  string(FIND "${rest}" "// [end example]" end)
  if(end EQUAL -1)
    message(FATAL_ERROR "${header}: example ${name} has no '// [end example]'")
  endif()
  string(SUBSTRING "${rest}" 0 ${end} code)
  string(REGEX REPLACE "(^|\n)//" "\\1" code "${code}")
  set(out ${CMAKE_BINARY_DIR}/examples/${name}.inc)
  file(WRITE ${out}.tmp "// Example ${name} of ${header}, as it stands there.\n${code}")
  file(COPY_FILE ${out}.tmp ${out} ONLY_IF_DIFFERENT)
  file(REMOVE ${out}.tmp)
endfunction()

# ddpx_readme_example(NAME FILE): the same for a Markdown file (the README),
# whose examples are fenced code blocks between "<!-- [example NAME] -->" and
# "<!-- [end example] -->" lines: their text, less the fence lines.
function(ddpx_readme_example name file)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${file})
  file(READ ${file} text)
  set(begin_mark "<!-- [example ${name}] -->\n")
  string(FIND "${text}" "${begin_mark}" begin)
  if(begin EQUAL -1)
    message(FATAL_ERROR "${file} has no '<!-- [example ${name}] -->'")
  endif()
  string(LENGTH "${begin_mark}" mark_length)
  math(EXPR begin "${begin} + ${mark_length}")
  string(SUBSTRING "${text}" ${begin} -1 rest)
  string(FIND "${rest}" "<!-- [end example] -->" end)
  if(end EQUAL -1)
    message(FATAL_ERROR "${file}: example ${name} has no '<!-- [end example] -->'")
  endif()
  string(SUBSTRING "${rest}" 0 ${end} code)
  string(REGEX REPLACE "(^|\n)```[a-z]*\n" "\\1" code "${code}")
  set(out ${CMAKE_BINARY_DIR}/examples/${name}.inc)
  file(WRITE ${out}.tmp "// Example ${name} of ${file}, as it stands there.\n${code}")
  file(COPY_FILE ${out}.tmp ${out} ONLY_IF_DIFFERENT)
  file(REMOVE ${out}.tmp)
endfunction()
