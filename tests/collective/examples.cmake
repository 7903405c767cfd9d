# The README's program runs as shown: world size 1 (one process), one epoch, from no checkpoint
# (it removes the last run's first). It writes model.pt and checkpoints/ into its working
# directory, a folder of the build tree.
if(TARGET example_readme_train)
  set(fashion_mnist /usr/share/datasets/fashion-mnist)  # ddp::kFashionMnistDefaultDir
  set(readme_train_dir ${CMAKE_CURRENT_BINARY_DIR}/readme_train)
  file(MAKE_DIRECTORY ${readme_train_dir})
  add_test(NAME test_readme_train
           COMMAND sh -c "test -d ${fashion_mnist} || { echo \"SKIPPED: needs \
dataset-fashion-mnist in ${fashion_mnist} (scripts/install-deps.sh)\"; exit 77; }; \
rm -rf checkpoints && exec \"$0\" 1 checkpoints" $<TARGET_FILE:example_readme_train>
           WORKING_DIRECTORY ${readme_train_dir})
  set_tests_properties(test_readme_train PROPERTIES LABELS collective TIMEOUT 120
                       SKIP_RETURN_CODE 77)
endif()
