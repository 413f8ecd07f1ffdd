"""Repository rule exposing an installed LibTorch as @libtorch//:libtorch.

Reads LIBTORCH_HOME (a folder with include/ and lib/, e.g. a pip torch's package folder);
without it, uses Debian's libtorch-dev layout (ATen in /usr/include, the C++ API under
/usr/include/torch/csrc/api/include, libraries in the default linker path).
"""

def _libtorch_repository_impl(ctx):
    home = ctx.os.environ.get("LIBTORCH_HOME", "")
    if home:
        ctx.symlink(home + "/include", "include")
        ctx.symlink(home + "/include/torch/csrc/api/include", "api_include")
        linkopts = [
            "-L" + home + "/lib",
            "-Wl,-rpath," + home + "/lib",
            "-Wl,--no-as-needed",
            "-ltorch",
            "-ltorch_cpu",
            "-lc10",
            "-Wl,--as-needed",
        ]
        includes = ["include", "api_include"]
        hdrs = 'glob(["include/**", "api_include/**"])'
    else:
        ctx.symlink("/usr/include/torch/csrc/api/include", "api_include")
        linkopts = [
            "-Wl,--no-as-needed",
            "-ltorch",
            "-ltorch_cpu",
            "-lc10",
            "-Wl,--as-needed",
            "-lpthread",
        ]
        includes = ["api_include"]
        hdrs = 'glob(["api_include/**"])'
    ctx.file("WORKSPACE", 'workspace(name = "libtorch")\n')
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "libtorch",
    hdrs = {hdrs},
    includes = {includes},
    linkopts = {linkopts},
)
""".format(hdrs = hdrs, includes = repr(includes), linkopts = repr(linkopts)))

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    environ = ["LIBTORCH_HOME"],
    local = True,
)
