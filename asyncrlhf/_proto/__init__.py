"""Generated gRPC/protobuf stubs for proto/asyncrlhf/v1 (`make proto`); do not edit."""
