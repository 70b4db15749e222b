//! Compiles the KServe v2 / Triton gRPC protocol (proto/, vendored from
//! triton-inference-server/common) into the server side of `inference.GRPCInferenceService`.
//! protoc comes from the `protoc-bin-vendored` crate, so no system package is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // prost-build runs the protoc that PROTOC names.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        // The upstream comments are Sphinx markup; as rustdoc they would become doctests.
        .disable_comments(["."])
        .compile_protos(&["proto/grpc_service.proto"], &["proto"])?;
    Ok(())
}
