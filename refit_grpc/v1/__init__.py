"""Generated gRPC code for refit_grpc.v1 (built from protos/, never edited by hand)."""
