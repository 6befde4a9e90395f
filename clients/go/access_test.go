package kunci

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

type certs struct {
	dir                   string
	caPEM                 string // file
	serverCert, serverKey string // files
	pool                  *x509.CertPool
	clientCert            tls.Certificate
	otherPool             *x509.CertPool // a CA that signed nothing here
	clientCA              string         // file: the CA of client certificates
}

func newCA(t *testing.T, name string) (*x509.Certificate, *ecdsa.PrivateKey, []byte) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return cert, key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func issue(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey, serial int64, usage x509.ExtKeyUsage) ([]byte, []byte) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: "localhost"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
}

func makeCerts(t *testing.T) *certs {
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	ca, caKey, caPEM := newCA(t, "kunci test CA")
	serverPEM, serverKeyPEM := issue(t, ca, caKey, 2, x509.ExtKeyUsageServerAuth)
	clientCA, clientCAKey, clientCAPEM := newCA(t, "kunci client CA")
	clientPEM, clientKeyPEM := issue(t, clientCA, clientCAKey, 3, x509.ExtKeyUsageClientAuth)
	clientCert, err := tls.X509KeyPair(clientPEM, clientKeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	_, _, otherPEM := newCA(t, "another CA")
	c := &certs{dir: dir, caPEM: write("ca.pem", caPEM), serverCert: write("server.pem", serverPEM),
		serverKey: write("server.key", serverKeyPEM), clientCert: clientCert,
		clientCA: write("client-ca.pem", clientCAPEM)}
	c.pool = x509.NewCertPool()
	c.pool.AppendCertsFromPEM(caPEM)
	c.otherPool = x509.NewCertPool()
	c.otherPool.AppendCertsFromPEM(otherPEM)
	return c
}

func TestTLS(t *testing.T) {
	cs := makeCerts(t)
	srv := startServer(t, "--listen", "tls://127.0.0.1:0", "--tls-cert", cs.serverCert, "--tls-key", cs.serverKey)
	if !strings.HasPrefix(srv.address, "tls://") {
		t.Fatalf("listening on %s", srv.address)
	}
	// TLS(config) with a private CA; then tls:// with $KUNCI_TLS_CA.
	c := dial(t, srv.address, TLS(&tls.Config{RootCAs: cs.pool}))
	tk, err := c.Acquire(bg(), "k")
	if err != nil {
		t.Fatal(err)
	}
	if err := tk.Release(bg()); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KUNCI_TLS_CA", cs.caPEM)
	c2 := dial(t, strings.Replace(srv.address, "127.0.0.1", "localhost", 1))
	if _, err := c2.Ping(bg()); err != nil {
		t.Fatal(err)
	}
	// A server this client does not trust: ErrUnavailable at once, the
	// problem named.
	c3 := dial(t, srv.address, TLS(&tls.Config{RootCAs: cs.otherPool}))
	start := time.Now()
	_, err = c3.Ping(bg())
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "not trusted") {
		t.Fatalf("%v, want ErrUnavailable: not trusted", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("took %v", took)
	}
}

func TestTLSClientCertificate(t *testing.T) {
	t.Parallel()
	cs := makeCerts(t)
	srv := startServer(t, "--listen", "tls://127.0.0.1:0", "--tls-cert", cs.serverCert, "--tls-key", cs.serverKey,
		"--tls-client-ca", cs.clientCA)
	c := dial(t, srv.address, TLS(&tls.Config{RootCAs: cs.pool, Certificates: []tls.Certificate{cs.clientCert}}))
	if _, err := c.Acquire(bg(), "k"); err != nil {
		t.Fatal(err)
	}
	// Without a certificate the server refuses the client:
	// ErrPermissionDenied, promptly.
	anon := dial(t, srv.address, TLS(&tls.Config{RootCAs: cs.pool}))
	start := time.Now()
	_, err := anon.Acquire(bg(), "k2")
	if !errors.Is(err, ErrPermissionDenied) {
		t.Fatalf("%v, want ErrPermissionDenied", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("took %v", took)
	}
}

// kunciSecret runs `kunci secret NAME SCOPE…`: the secret and its --auth line.
func kunciSecret(t *testing.T, name string, scopes ...string) (string, string) {
	out, err := exec.Command(kunciBin(t), append([]string{"secret", name}, scopes...)...).Output()
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 2 {
		t.Fatalf("kunci secret printed %q", out)
	}
	return lines[0], lines[1]
}

func TestSecrets(t *testing.T) {
	secret, line := kunciSecret(t, "app", "lock:app-", "info")
	auth := filepath.Join(t.TempDir(), "auth")
	if err := os.WriteFile(auth, []byte(line+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "kunci.sock")
	srv := startServer(t, "--auth", auth, "--listen", "127.0.0.1:0", "--listen", "unix:"+sock)
	c := dial(t, srv.address, Secret(secret+"\n"))
	tk, err := c.Acquire(bg(), "app-1")
	if err != nil {
		t.Fatal(err)
	}
	// Outside the scopes: X 13 ends that request only.
	if _, err := c.Acquire(bg(), "other"); !errors.Is(err, ErrPermissionDenied) {
		t.Fatalf("%v, want ErrPermissionDenied", err)
	}
	if err := tk.Release(bg()); err != nil {
		t.Fatalf("the session did not go on after X 13: %v", err)
	}
	// From a file, over the unix socket; from KUNCI_SECRET.
	file := filepath.Join(dir, "secret")
	if err := os.WriteFile(file, []byte(secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := dial(t, "unix:"+sock, SecretFile(file)).Info(bg()); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KUNCI_SECRET", secret)
	if _, err := dial(t, srv.address).Ping(bg()); err != nil {
		t.Fatal(err)
	}
	// A wrong secret, or none: ErrPermissionDenied, nothing executed.
	wrong := dial(t, srv.address, Secret(strings.Repeat("w", 40)))
	if _, err := wrong.Acquire(bg(), "app-2"); !errors.Is(err, ErrPermissionDenied) {
		t.Fatalf("wrong secret: %v", err)
	}
	os.Unsetenv("KUNCI_SECRET")
	none := dial(t, srv.address)
	if _, err := none.Acquire(bg(), "app-2"); !errors.Is(err, ErrPermissionDenied) {
		t.Fatalf("no secret: %v", err)
	}
	if st, _ := c.Query(bg(), "app-2"); st != nil {
		t.Fatal("a refused session acquired")
	}
}

// Spec §12.5: a secret is refused before connecting to an address that
// is neither TLS, loopback nor a unix socket, and one under 32 bytes is
// refused at once.
func TestSecretNeverInClear(t *testing.T) {
	secret := strings.Repeat("s", 32)
	if _, err := Dial("10.1.2.3:5862", Secret(secret)); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "AllowPlaintextSecret") {
		t.Fatalf("%v, want ErrInvalidArgument naming AllowPlaintextSecret", err)
	}
	if _, err := Dial("example.com:5862", Secret(secret)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("%v", err)
	}
	for _, ok := range []string{"127.0.0.2:5862", "[::1]:5862", "localhost:5862", "unix:/tmp/x", "tls://10.1.2.3:5862"} {
		c, err := Dial(ok, Secret(secret))
		if err != nil {
			t.Fatalf("%s: %v", ok, err)
		}
		c.Close()
	}
	c, err := Dial("10.1.2.3:5862", Secret(secret), AllowPlaintextSecret())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, err := Dial("127.0.0.1:5862", Secret("short")); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("short secret: %v", err)
	}
	t.Setenv("KUNCI_SECRET", "short")
	if _, err := Dial("127.0.0.1:5862"); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "KUNCI_SECRET") {
		t.Fatalf("short KUNCI_SECRET: %v", err)
	}
}

// KUNCI_SERVER with several addresses (the first refuses), one a unix
// socket.
func TestKunciServerWithSeveralAddresses(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "k.sock")
	startServer(t, "--listen", "unix:"+sock)
	t.Setenv("KUNCI_SERVER", deadAddress(t)+", unix:"+sock)
	c := dial(t, "")
	tk, err := c.Acquire(bg(), "k")
	if err != nil {
		t.Fatal(err)
	}
	if err := tk.Release(bg()); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KUNCI_SERVER", "nonsense")
	if _, err := Dial(""); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "KUNCI_SERVER") {
		t.Fatalf("%v", err)
	}
}
