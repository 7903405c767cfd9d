# The README's program runs as shown: world size 1 (one process, Gloo on 127.0.0.1), one epoch
# cut to 20 steps. It writes model.pt into its working directory, a folder of the build tree.
if(TARGET example_readme_train)
  set(fashion_mnist /usr/share/datasets/fashion-mnist)  # ddp::kFashionMnistDefaultDir
  set(readme_train_dir ${CMAKE_CURRENT_BINARY_DIR}/readme_train)
  file(MAKE_DIRECTORY ${readme_train_dir})
  add_test(NAME test_readme_train
           COMMAND sh -c "test -d ${fashion_mnist} || { echo \"SKIPPED: needs \
dataset-fashion-mnist in ${fashion_mnist} (scripts/install-deps.sh)\"; exit 77; }; \
exec \"$0\" 1 20" $<TARGET_FILE:example_readme_train>
           WORKING_DIRECTORY ${readme_train_dir})
  set_tests_properties(test_readme_train PROPERTIES LABELS collective TIMEOUT 120
                       SKIP_RETURN_CODE 77)
endif()
