fn main() -> std::process::ExitCode {
    kunci::cli::main()
}
