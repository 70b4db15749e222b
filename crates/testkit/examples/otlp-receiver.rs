//! A counting OTLP receiver for benchmarks: `otlp-receiver GRPC_ADDR HTTP_ADDR` listens on both
//! and prints the spans and export requests received every 10 s (nothing is kept).

use std::time::Duration;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let grpc = args.next().unwrap_or_else(|| "127.0.0.1:4317".into());
    let http = args.next().unwrap_or_else(|| "127.0.0.1:4318".into());
    let receiver = testkit::otlp::Receiver::start_on(grpc.as_str(), http.as_str(), false).await?;
    println!(
        "listening: grpc {} http {}",
        receiver.grpc_endpoint, receiver.http_endpoint
    );
    loop {
        tokio::time::sleep(Duration::from_secs(10)).await;
        println!(
            "spans {} requests {}",
            receiver.span_count(),
            receiver.request_count()
        );
    }
}
