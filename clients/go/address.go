package kunci

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"strconv"
	"strings"
)

// address is one server address: "tcp" HOST:PORT, "tls" HOST:PORT or
// "unix" PATH.
type address struct {
	kind string
	host string // tcp, tls: the host; unix: the path
	port int
}

func (a address) String() string {
	switch a.kind {
	case "unix":
		return "unix:" + a.host
	case "tls":
		return "tls://" + net.JoinHostPort(a.host, strconv.Itoa(a.port))
	}
	return net.JoinHostPort(a.host, strconv.Itoa(a.port))
}

func (a address) dialTarget() string {
	if a.kind == "unix" {
		return a.host
	}
	return net.JoinHostPort(a.host, strconv.Itoa(a.port))
}

func parseAddress(text string) (address, error) {
	text = strings.TrimSpace(text)
	if strings.HasPrefix(text, "unix:") {
		path := text[len("unix:"):]
		if path == "" {
			return address{}, invalid("unix: address without a path")
		}
		return address{kind: "unix", host: path}, nil
	}
	kind := "tcp"
	if i := strings.Index(text, "://"); i >= 0 {
		if !strings.EqualFold(text[:i], "tls") {
			return address{}, invalid("address %q: the Go client takes HOST:PORT, tls://HOST:PORT or unix:PATH", text)
		}
		kind = "tls"
		text = text[i+3:]
	}
	host, port, err := net.SplitHostPort(text)
	if err != nil || host == "" {
		return address{}, invalid("address %q is not HOST:PORT, tls://HOST:PORT or unix:PATH", text)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return address{}, invalid("address %q: bad port", text)
	}
	return address{kind: kind, host: host, port: n}, nil
}

// resolveAddresses parses the comma-separated list text; "" means
// $KUNCI_SERVER, else DefaultServer.
func resolveAddresses(text string) ([]address, error) {
	source := ""
	if strings.TrimSpace(text) == "" {
		text = os.Getenv("KUNCI_SERVER")
		source = "KUNCI_SERVER: "
		if strings.TrimSpace(text) == "" {
			text, source = DefaultServer, ""
		}
	}
	var addresses []address
	for _, item := range strings.Split(text, ",") {
		if strings.TrimSpace(item) == "" {
			continue
		}
		a, err := parseAddress(item)
		if err != nil {
			if source != "" {
				return nil, invalid("%s%v", source, err.(*Error).Detail)
			}
			return nil, err
		}
		addresses = append(addresses, a)
	}
	if len(addresses) == 0 {
		return nil, invalid("a client needs at least one server address")
	}
	return addresses, nil
}

// isLoopbackHost: an IP literal in 127.0.0.0/8 or ::1 (also IPv4-mapped),
// or localhost. A name is never looked up.
func isLoopbackHost(host string) bool {
	if strings.EqualFold(strings.TrimSuffix(host, "."), "localhost") {
		return true
	}
	if i := strings.IndexByte(host, '%'); i >= 0 {
		host = host[:i]
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// defaultTLS is the trust for tls:// addresses without TLS(...): the CA
// file in $KUNCI_TLS_CA (as the kunci command reads it), else the
// system's.
func defaultTLS() (*tls.Config, error) {
	file := os.Getenv("KUNCI_TLS_CA")
	if file == "" {
		return &tls.Config{MinVersion: tls.VersionTLS12}, nil
	}
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, invalid("KUNCI_TLS_CA %q: %v", file, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, invalid("KUNCI_TLS_CA %q: no PEM certificate in it", file)
	}
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, nil
}
